"""Row-wise argmax of float32 logits on CPU, compiled by numba: the CPU sampler's greedy pick.

torch's CPU argmax compares one element at a time; this kernel takes the max of each block of
64 logits with vector instructions and scans a block only when it beats the best so far,
which after the first few blocks is rare; the same pass tells whether the row is all finite.
bench/RESULTS.md has what it measured against torch's argmax.
Ties go to the first index, as in torch. A row holding a NaN gets an arbitrary index where
torch returns the NaN's; the sampler fails such rows whatever their token.
"""

import numba
import numpy as np
import torch

from kernels._numba import FASTMATH, use_torch_thread_count

BLOCK = 64


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True, parallel=True)
def _argmax_rows(x, out, finite):  # pragma: no cover - compiled
    for r in numba.prange(x.shape[0]):
        row = x[r]
        blocked = row.size - row.size % BLOCK
        best, best_index = row[0], 0
        for start in range(0, blocked, BLOCK):
            block_max = row[start]
            for i in range(start + 1, start + BLOCK):
                block_max = max(block_max, row[i])
            if block_max > best:
                best, best_index = _first_above(row, start, start + BLOCK, best, best_index)
        out[r] = _first_above(row, blocked, row.size, best, best_index)[1]
        finite[r] = _all_finite(row)


@numba.njit(fastmath=FASTMATH, inline="always", nogil=True)
def _all_finite(row):  # pragma: no cover - compiled
    # x * 0 is 0 for a finite x and NaN for a NaN or an infinity. A loop of its own: folded into
    # the max loop above, it kept that loop from vectorizing.
    zeros = np.float32(0.0)
    for i in range(row.size):
        zeros += row[i] * np.float32(0.0)
    return zeros == 0


@numba.njit(fastmath=FASTMATH, inline="always", nogil=True)
def _first_above(row, start, stop, best, best_index):  # pragma: no cover - compiled
    for i in range(start, stop):
        if row[i] > best:
            best, best_index = row[i], i
    return best, best_index


def supports(logits: torch.Tensor) -> bool:
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.shape[-1] > 0


def argmax_rows_cpu(logits: torch.Tensor, finite: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] float32 -> [N] int64, the index of each row's largest value. `finite` [N]
    bool, when given, gets whether each row holds no NaN or infinity, from the same pass (the
    fast-math flags keep x * 0 a NaN for a NaN or an infinity)."""
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    finite = finite if finite is not None else torch.empty(logits.shape[0], dtype=torch.bool)
    use_torch_thread_count()
    _argmax_rows(logits.contiguous().numpy(), out.numpy(), finite.numpy())
    return out
