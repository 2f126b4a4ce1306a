"""LoRA's shrink over a batch whose rows use different adapters and ranks (Punica's SGMV, as vLLM's
Triton LoRA kernels run it): each row's activations times its adapter's A, into a few columns.

The batch's rows that use an adapter are listed grouped by adapter slot (`tokens`, with
`group_ends` the cumulative row count of each slot, as torch's grouped GEMM takes offsets), so a
program multiplies a block of one slot's rows by that slot's A: one read of the weights per block
of rows, however the adapters are spread over the batch. A decode step is the case of one row per
request (BGMV's shape), a prefill that of long runs per adapter (SGMV's).

A projection's A stack is [slots, n_slices * R, in]: slice s (q, k, v of a fused qkv projection)
holds its rank's rows at [s * R, s * R + rank), zeros after them. One program reads x once for
every slice's columns it covers (the fusion over slices), and skips the columns past each
slice's rank. Programs cover every slot and the worst-case blocks of rows; those past their
slot's rows return at once: the grid depends on shapes alone, as CUDA graphs need.

The result, [rows, n_slices * R] in rows' listed order, is in the activations' dtype, as
peft's lora_A output is; kernels/lora_expand.py takes it from there.

On CPU the reference runs: the listed rows gathered, then one matrix product per slot that has
rows. torch's grouped GEMM (F.grouped_mm) computes the same, but its CPU path ran each group
several times slower than a plain product of the same shape (bench/RESULTS.md, "LoRA adapters").
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.decode_attention import dot_precision


def lora_shrink_reference(
    x: torch.Tensor, a: torch.Tensor, tokens: torch.Tensor, group_ends: torch.Tensor
) -> torch.Tensor:
    """The rows `tokens` of x, grouped by slot, times their slot's A (whose padded rows are zeros,
    so they add nothing). Rows listed past the last slot's are not rows (a decode graph's static
    buffer)."""
    ends = group_ends.tolist()
    rows = x.index_select(0, tokens[: ends[-1]])
    # F.linear: on CPU its product ran several times faster than torch.mm of the transpose.
    parts = [
        F.linear(rows[start:end], a[slot]) for slot, (start, end) in enumerate(zip([0, *ends], ends)) if end > start
    ]
    return torch.cat(parts) if parts else rows.new_empty(0, a.shape[1])


@triton.jit
def _group_rows(group_ends_ptr, slot, block_m, BLOCK_M: tl.constexpr):
    """The listed rows of `slot` in this program's block, and which of them exist."""
    end = tl.load(group_ends_ptr + slot)
    start = tl.load(group_ends_ptr + slot - 1, mask=slot > 0, other=0)
    rows = start + block_m * BLOCK_M + tl.arange(0, BLOCK_M)
    return rows, rows < end, start + block_m * BLOCK_M < end


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    a_ptr,
    out_ptr,
    tokens_ptr,
    group_ends_ptr,
    ranks_ptr,
    hidden,
    num_slices,
    max_rank,
    x_stride,
    a_slot_stride,
    a_row_stride,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    slot = tl.program_id(2)
    rows, row_ok, in_use = _group_rows(group_ends_ptr, slot, tl.program_id(0), BLOCK_M)
    if not in_use:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    width = num_slices * max_rank
    rank = tl.load(ranks_ptr + slot * num_slices + cols // max_rank, mask=cols < width, other=0)
    col_ok = cols % max_rank < rank
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if tl.max(col_ok.to(tl.int32), axis=0) > 0:
        token = tl.load(tokens_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        a_rows = a_ptr + slot.to(tl.int64) * a_slot_stride + cols[None, :].to(tl.int64) * a_row_stride
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < hidden
            xs = tl.load(
                x_ptr + token[:, None] * x_stride + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0
            )
            w = tl.load(a_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(xs, w, acc, input_precision=DOT_PRECISION)
    out = out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (cols < width)[None, :])


def block_m_for(rows: int, slots: int) -> int:
    """Blocks of 16 rows while each adapter has few (decode), larger for prefill's long runs."""
    per_slot = rows / max(slots, 1)
    return 16 if per_slot <= 32 else 32 if per_slot <= 128 else 64


def lora_shrink_triton(
    x: torch.Tensor, a: torch.Tensor, tokens: torch.Tensor, group_ends: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    slots, width, hidden = a.shape
    out = torch.empty(tokens.shape[0], width, dtype=x.dtype, device=x.device)
    if tokens.shape[0] == 0:
        return out
    block_m = block_m_for(tokens.shape[0], slots)
    block_n = min(64, triton.next_power_of_2(width))
    fp32 = x.dtype == torch.float32
    grid = (triton.cdiv(tokens.shape[0], block_m), triton.cdiv(width, block_n), slots)
    _lora_shrink_kernel[grid](
        x,
        a,
        out,
        tokens,
        group_ends,
        ranks,
        hidden,
        ranks.shape[1],
        width // ranks.shape[1],
        x.stride(0),
        a.stride(0),
        a.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=32 if fp32 else 64,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=4,
        num_stages=2,
    )
    return out


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, tokens: torch.Tensor, group_ends: torch.Tensor, ranks: torch.Tensor
) -> torch.Tensor:
    """x [T, in] (rows contiguous), A [S, n * R, in], tokens [N] (rows of x, grouped by slot),
    group_ends [S] int32 (cumulative rows per slot), ranks [S, n] int32 -> [N, n * R] in x's dtype:
    row i is x[tokens[i]] times its slot's A, zero past each slice's rank."""
    if use_triton(x):
        return lora_shrink_triton(x, a, tokens, group_ends, ranks)
    return lora_shrink_reference(x, a, tokens, group_ends)
