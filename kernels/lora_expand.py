"""LoRA's expand over a batch whose rows use different adapters and ranks (Punica's SGMV, as in
kernels/lora_shrink.py): each row's shrunk activations times its adapter's B, scaled, added into
the base projection's output in place.

A projection's B stack is [slots, out, R]: the output columns of slice s (q, k, v of a fused
qkv projection) read columns [0, rank) of their rows, and the shrunk activations' columns
[s * R, s * R + rank). A program covers one (slot, slice) pair, a block of that slot's rows and
a block of the slice's output columns, loops over the slice's rank only (adapters of different
ranks share a batch), and adds `scale * (shrunk @ B.T)` into the rows of `out` its tokens own:
the add is fused, so the update never exists as a tensor of its own. A row uses one adapter and
slices own disjoint columns, so no two programs write one element. The grid depends on shapes
alone (every slot and slice, the worst-case row blocks), as CUDA graphs need.

The product is scaled in float32 and added to the output, rounded once; peft computes
`result + lora_B(lora_A(x)) * scaling`, the same terms. On CPU the reference runs: a product per
slot and slice, over the slice's rank only, then one indexed add into the output.
"""

import itertools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.decode_attention import dot_precision
from kernels.lora_shrink import _group_rows, block_m_for

MAX_SLICES = 3  # q, k and v


def lora_expand_reference(
    shrunk: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    tokens: torch.Tensor,
    group_ends: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slices: tuple[int, ...],
) -> None:
    """Each slot's rows times each slice's B over its rank, scaled, added into out's rows `tokens`
    at once."""
    ends, ranks, scales = group_ends.tolist(), ranks.tolist(), scales.tolist()
    max_rank = b.shape[2]
    update = torch.zeros(ends[-1], b.shape[1], dtype=out.dtype, device=out.device)
    for slot, (start, end) in enumerate(zip([0, *ends], ends)):
        for s, (lo, hi) in enumerate(itertools.pairwise(slices)):
            r = ranks[slot][s]
            if end > start and r:
                part = F.linear(shrunk[start:end, s * max_rank : s * max_rank + r], b[slot, lo:hi, :r])
                torch.mul(part, scales[slot][s], out=update[start:end, lo:hi])
    out.index_add_(0, tokens[: ends[-1]], update)


@triton.jit
def _lora_expand_kernel(
    shrunk_ptr,
    b_ptr,
    out_ptr,
    tokens_ptr,
    group_ends_ptr,
    ranks_ptr,
    scales_ptr,
    num_slices,
    max_rank,
    end0,
    end1,
    end2,
    shrunk_stride,
    b_slot_stride,
    b_row_stride,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    slot = tl.program_id(2) // num_slices
    s = tl.program_id(2) % num_slices
    rank = tl.load(ranks_ptr + slot * num_slices + s)
    col0 = tl.where(s == 0, 0, tl.where(s == 1, end0, end1))
    width = tl.where(s == 0, end0, tl.where(s == 1, end1, end2)) - col0
    rows, row_ok, in_use = _group_rows(group_ends_ptr, slot, tl.program_id(0), BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if not in_use:
        return
    if (rank == 0) | (tl.program_id(1) * BLOCK_N >= width):
        return
    col_ok = cols < width
    b_rows = b_ptr + slot.to(tl.int64) * b_slot_stride + (col0 + cols[None, :]).to(tl.int64) * b_row_stride
    shrunk_rows = shrunk_ptr + rows[:, None].to(tl.int64) * shrunk_stride + s * max_rank
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, rank, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < rank
        xs = tl.load(shrunk_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(b_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(xs, w, acc, input_precision=DOT_PRECISION)
    token = tl.load(tokens_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    dest = out_ptr + token[:, None] * out_stride + col0 + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    before = tl.load(dest, mask=mask, other=0.0).to(tl.float32)
    scale = tl.load(scales_ptr + slot * num_slices + s)
    tl.store(dest, (before + acc * scale).to(out_ptr.dtype.element_ty), mask=mask)


def lora_expand_triton(
    shrunk: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    tokens: torch.Tensor,
    group_ends: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slices: tuple[int, ...],
) -> None:
    slots, _, max_rank = b.shape
    num_slices = len(slices) - 1
    if tokens.shape[0] == 0:
        return
    ends = list(slices[1:]) + [slices[-1]] * (MAX_SLICES - num_slices)
    widest = max(hi - lo for lo, hi in itertools.pairwise(slices))
    block_m = block_m_for(tokens.shape[0], slots)
    block_n = min(128 if out.dtype != torch.float32 else 64, triton.next_power_of_2(widest))
    grid = (triton.cdiv(tokens.shape[0], block_m), triton.cdiv(widest, block_n), slots * num_slices)
    _lora_expand_kernel[grid](
        shrunk,
        b,
        out,
        tokens,
        group_ends,
        ranks,
        scales,
        num_slices,
        max_rank,
        *ends,
        shrunk.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=16,
        DOT_PRECISION=dot_precision(shrunk.dtype),
        num_warps=4,
        num_stages=2,
    )


def lora_expand(
    shrunk: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    tokens: torch.Tensor,
    group_ends: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    slices: tuple[int, ...],
) -> None:
    """out[tokens[i], slice s] += scales[slot, s] * shrunk[i, slice s] @ B[slot, slice s].T for
    each listed row i (of the slot whose rows group_ends puts it among). shrunk [N, n * R] from lora_shrink, B [S, out, R],
    out [T, out] (rows contiguous), ranks [S, n] int32, scales [S, n] float32; `slices` the
    output column offsets of the n slices and their end: (0, q, q + kv, q + 2 kv) for qkv."""
    if use_triton(out):
        lora_expand_triton(shrunk, b, out, tokens, group_ends, ranks, scales, slices)
    else:
        lora_expand_reference(shrunk, b, out, tokens, group_ends, ranks, scales, slices)
