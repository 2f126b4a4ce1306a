"""x @ w.T for float32 on CPU when x has few rows, compiled by numba: the CPU engine's LM head,
and its projections in a step of a few rows (worker/model/qwen3.py, FEW_ROWS).

Each decode step multiplies a few hidden rows by the whole [vocab, hidden] head, 311 MB for
Qwen3's vocabulary at hidden 512. BLAS packs that weight into its own layout on every call,
which for so few rows costs about as much as the arithmetic. These kernels read the weight once,
in place, blocks of its rows spread over torch's thread count:

- up to FEW_ROWS rows (a decode step of a few requests, a verify step of one): each block of
  ROW_BLOCK weight rows is streamed from memory once, one weight row at a time (the order the
  hardware prefetcher follows), and stays in L2 while every pair of x rows is multiplied by it.
  A row's dot products are the same bits whether it is alone or among up to FEW_ROWS rows, in
  either place of a pair: a speculative verify step of 1 + k tokens computes each token's
  logits exactly as the decode step without speculation would.
- more rows: 8 weight rows stay in L1 while every pair of x rows is multiplied by them, 16 dot
  products accumulating in vector registers (arithmetic, not the stream, bounds this case).

bench/RESULTS.md has what they measured against MKL and each other.
"""

import numba
import numpy as np
import torch

from kernels._numba import FASTMATH, use_torch_thread_count

W_BLOCK = 8  # weight rows per block; with 2 x rows, 16 accumulators fit the 32 vector registers
FEW_ROWS = 8  # up to this many x rows, the streaming kernel, the same bits per row whatever their count
ROW_BLOCK = 64  # weight rows streamed per block of the streaming kernel: 128 KB at hidden 512, in L2


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True, parallel=True)
def _matmul_wt_few(x, w, out):  # pragma: no cover - compiled
    rows, cols = x.shape[0], w.shape[0]
    paired_rows = rows - rows % 2
    for block in numba.prange((cols + ROW_BLOCK - 1) // ROW_BLOCK):
        start, stop = block * ROW_BLOCK, min(cols, (block + 1) * ROW_BLOCK)
        for r in range(0, paired_rows, 2):
            for c in range(start, stop):
                out[r, c], out[r + 1, c] = _pair_dots(x[r], x[r + 1], w[c])
        if paired_rows < rows:
            for c in range(start, stop):
                out[rows - 1, c] = _dot(x[rows - 1], w[c])


# _pair_dots's two sums and _dot's one compile to the same vector reduction (LLVM gives each sum
# of a loop the same vector width and interleave): tests/kernels/test_cpu_linear.py checks that a
# row's bits do not depend on the rows beside it, which is what keeps verify = decode.
@numba.njit(fastmath=FASTMATH, inline="always", nogil=True)
def _pair_dots(x0, x1, w_row):  # pragma: no cover - compiled
    """(x0 . w_row, x1 . w_row), loading the weight row once for both."""
    a = b = np.float32(0.0)
    for k in range(w_row.shape[0]):
        v = w_row[k]
        a += x0[k] * v
        b += x1[k] * v
    return a, b


@numba.njit(fastmath=FASTMATH, inline="always", nogil=True)
def _dot(x0, w_row):  # pragma: no cover - compiled
    total = np.float32(0.0)
    for k in range(w_row.shape[0]):
        total += x0[k] * w_row[k]
    return total


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True, parallel=True)
def _matmul_wt(x, w, out):  # pragma: no cover - compiled
    rows, cols = x.shape[0], w.shape[0]
    paired_rows, blocked_cols = rows - rows % 2, cols - cols % W_BLOCK
    for block in numba.prange(blocked_cols // W_BLOCK):
        c = block * W_BLOCK
        for r in range(0, paired_rows, 2):
            _block(x[r], x[r + 1], w, c, out[r], out[r + 1])
        if paired_rows < rows:
            _dots(x[rows - 1], w, c, c + W_BLOCK, out[rows - 1])
    for r in range(rows):
        _dots(x[r], w, blocked_cols, cols, out[r])


@numba.njit(fastmath=FASTMATH, inline="always", nogil=True)  # a call per block measured ~10% slower
def _block(x0, x1, w, c, out0, out1):  # pragma: no cover - compiled
    """out0[c:c+8] = w[c:c+8] @ x0 and out1 likewise: 16 dot products in one pass over the rows."""
    w0, w1, w2, w3, w4, w5, w6, w7 = w[c], w[c + 1], w[c + 2], w[c + 3], w[c + 4], w[c + 5], w[c + 6], w[c + 7]
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
    for k in range(x0.shape[0]):
        u, v = x0[k], x1[k]
        a0 += u * w0[k]
        a1 += u * w1[k]
        a2 += u * w2[k]
        a3 += u * w3[k]
        a4 += u * w4[k]
        a5 += u * w5[k]
        a6 += u * w6[k]
        a7 += u * w7[k]
        b0 += v * w0[k]
        b1 += v * w1[k]
        b2 += v * w2[k]
        b3 += v * w3[k]
        b4 += v * w4[k]
        b5 += v * w5[k]
        b6 += v * w6[k]
        b7 += v * w7[k]
    out0[c], out0[c + 1], out0[c + 2], out0[c + 3] = a0, a1, a2, a3
    out0[c + 4], out0[c + 5], out0[c + 6], out0[c + 7] = a4, a5, a6, a7
    out1[c], out1[c + 1], out1[c + 2], out1[c + 3] = b0, b1, b2, b3
    out1[c + 4], out1[c + 5], out1[c + 6], out1[c + 7] = b4, b5, b6, b7


@numba.njit(fastmath=FASTMATH, inline="always", nogil=True)
def _dots(x_row, w, start, stop, out_row):  # pragma: no cover - compiled
    for c in range(start, stop):
        total = np.float32(0.0)
        for k in range(x_row.shape[0]):
            total += x_row[k] * w[c, k]
        out_row[c] = total


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == w.dtype == torch.float32


def linear_cpu(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] @ w[V, K].T -> [N, V] float32, into `out` when given (a contiguous [N, V])."""
    x, w = x.contiguous(), w.contiguous()
    if out is None:
        out = torch.empty(x.shape[0], w.shape[0], dtype=torch.float32)
    use_torch_thread_count()
    kernel = _matmul_wt_few if x.shape[0] <= FEW_ROWS else _matmul_wt
    kernel(x.numpy(), w.numpy(), out.numpy())
    return out
