"""(token, expert) pairs sorted by expert, each expert's run padded to whole blocks: the layout
the fused MoE GEMMs walk (kernels/fused_moe.py), as vLLM's and SGLang's moe_align_block_size.

Pair p = t * top_k + j stands for token t's j-th choice, expert topk_ids[t, j]. The sorted list
holds pair ids, each expert's in ascending order, and pads each expert's run with the sentinel
num_pairs up to a multiple of block_m; block b of the list then belongs to one expert,
expert_ids[b]. An expert no token chose takes no block.

Shapes depend on the batch, never on the routing: the list is sized for the worst case (every
expert that can be hit wasting block_m - 1 slots) and the length in use stays on the device
(num_padded), so nothing waits for the host and a CUDA graph captured once replays any
routing. Blocks past num_padded are skipped by the GEMMs; their expert id is -1.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton

CHUNK = 1024  # pairs each program reads per iteration


class ExpertBlocks(NamedTuple):
    sorted_pairs: torch.Tensor  # [max_padded_pairs] int32: pair ids grouped by expert; num_pairs pads
    expert_ids: torch.Tensor  # [max_padded_pairs / block_m] int32: each block's expert, -1 unused
    num_padded: torch.Tensor  # [1] int32: entries of sorted_pairs in use (a multiple of block_m)
    block_m: int


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """At most min(num_experts, num_pairs) experts are hit, each padding fewer than block_m slots."""
    return num_pairs + min(num_experts, num_pairs) * (block_m - 1)


def empty_blocks(num_pairs: int, num_experts: int, block_m: int, device: torch.device) -> ExpertBlocks:
    """Every entry padding, every block unused: what the launcher and the reference fill in."""
    size = max_padded_pairs(num_pairs, num_experts, block_m)
    return ExpertBlocks(
        torch.full((size,), num_pairs, dtype=torch.int32, device=device),
        torch.full((triton.cdiv(size, block_m),), -1, dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
        block_m,
    )


class PaddedRuns(NamedTuple):
    counts: torch.Tensor  # [E] int32: pairs per expert
    starts: torch.Tensor  # [E] int32: where each expert's padded run starts in the sorted list
    total: torch.Tensor  # [1] int32: the runs' padded length, summed


def padded_runs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> PaddedRuns:
    flat = topk_ids.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))  # bincount would sync to size itself
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0, dtype=torch.int32)
    return PaddedRuns(counts, ends - padded, ends[-1:])


def align_by_expert_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    flat = topk_ids.flatten()
    blocks = empty_blocks(flat.numel(), num_experts, block_m, flat.device)
    runs = padded_runs(topk_ids, num_experts, block_m)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(runs.counts, 0) - runs.counts)[experts]
    blocks.sorted_pairs[runs.starts[experts] + rank] = order.to(torch.int32)
    experts_of_blocks = torch.repeat_interleave(
        torch.arange(num_experts, dtype=torch.int32, device=flat.device),
        (runs.counts + block_m - 1) // block_m,
    )
    blocks.expert_ids[: experts_of_blocks.numel()] = experts_of_blocks
    blocks.num_padded.copy_(runs.total)
    return blocks


# The batch's pair count changes every step: not specialized on, so no step compiles a variant.
@triton.jit(do_not_specialize=["num_pairs"])
def _align_kernel(
    topk_ids_ptr,
    run_starts_ptr,
    sorted_pairs_ptr,
    expert_ids_ptr,
    num_pairs,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    # One program per expert: it finds its pairs in order, a chunk at a time (a chunk's matches
    # are ranked by a prefix sum), and writes them and its blocks' expert id.
    expert = tl.program_id(0)
    start = tl.load(run_starts_ptr + expert)
    found = 0
    for chunk_start in range(0, num_pairs, CHUNK):
        pairs = chunk_start + tl.arange(0, CHUNK)
        ids = tl.load(topk_ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
        hit = (ids == expert).to(tl.int32)
        rank = found + tl.cumsum(hit, 0) - hit
        tl.store(sorted_pairs_ptr + start + rank, pairs.to(tl.int32), mask=hit > 0)
        found += tl.sum(hit, 0)
    first_block = start // BLOCK_M
    for block in range(first_block, first_block + tl.cdiv(found, BLOCK_M)):
        tl.store(expert_ids_ptr + block, expert)


def align_by_expert_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    flat = topk_ids.flatten()
    blocks = empty_blocks(flat.numel(), num_experts, block_m, flat.device)
    if flat.numel() == 0:
        return blocks
    runs = padded_runs(topk_ids, num_experts, block_m)
    blocks.num_padded.copy_(runs.total)
    _align_kernel[(num_experts,)](
        flat,
        runs.starts,
        blocks.sorted_pairs,
        blocks.expert_ids,
        flat.numel(),
        BLOCK_M=block_m,
        CHUNK=CHUNK,
    )
    return blocks


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """topk_ids [T, k] (int64, each in [0, num_experts)) -> the sorted, padded pair layout."""
    if use_triton(topk_ids):
        return align_by_expert_triton(topk_ids, num_experts, block_m)
    return align_by_expert_reference(topk_ids, num_experts, block_m)
