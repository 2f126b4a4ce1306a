"""A mixture-of-experts MLP over every (token, expert) pair of a batch, in two grouped GEMM
launches (the fused MoE of vLLM and SGLang):

1. gate/up: each block of block_m pairs, all routed to one expert (kernels/moe_align.py),
   multiplies its tokens' hidden rows by that expert's gate and up rows; the epilogue takes
   silu(gate) * up and stores it in the pair's row of a [pairs, I] buffer.
2. down: each block multiplies its pairs' rows of that buffer by the expert's down weights,
   scales each by the pair's routing weight and stores it in the pair's row of [pairs, H].

A token's output is the sum of its k rows, added in torch (in order, so the result is
deterministic, which atomic adds into one row would not be). A pair is stored at its own
id, so a token routed to one expert twice gets two rows, and an expert no token chose costs
nothing. Programs cover the worst-case block count and those past the blocks in use return
at once: the launch grids depend on the batch alone, as CUDA graphs need.

On CPU the reference runs: the pairs sorted by expert in torch, then torch's grouped GEMM
(F.grouped_mm) for each projection. `fused_moe_per_expert_loop` is transformers' algorithm, a
loop over the experts hit: the tests' oracle and the benchmark's baseline.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.activation import silu_and_mul_reference
from kernels.decode_attention import dot_precision
from kernels.moe_align import ExpertBlocks, align_by_expert_triton


def fused_moe_per_expert_loop(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Each expert hit runs its tokens through its MLP, weighted, summed into their rows (in
    float32, then rounded once)."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for expert in topk_ids.unique().tolist():
        token, slot = torch.where(topk_ids == expert)
        gate, up = F.linear(hidden[token], w13[expert]).chunk(2, dim=-1)
        rows = F.linear(F.silu(gate) * up, w2[expert]) * topk_weights[token, slot, None]
        out.index_add_(0, token, rows.float())
    return out.to(hidden.dtype)


def fused_moe_reference(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The kernels' arithmetic in torch: pairs sorted by expert, one grouped GEMM per projection."""
    num_tokens, top_k = topk_ids.shape
    flat = topk_ids.flatten()
    order = torch.argsort(flat, stable=True)
    group_ends = torch.cumsum(torch.bincount(flat, minlength=w13.shape[0]), 0, dtype=torch.int32)
    x = torch.index_select(hidden, 0, order // top_k)
    act = silu_and_mul_reference(F.grouped_mm(x, w13.transpose(1, 2), offs=group_ends))
    rows = F.grouped_mm(act, w2.transpose(1, 2), offs=group_ends) * topk_weights.flatten()[order, None]
    per_pair = torch.empty_like(rows).index_copy_(0, order, rows)
    return per_pair.view(num_tokens, top_k, hidden.shape[1]).sum(1)


class Tiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def tile_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> Tiles:
    """Blocks of 16 pairs while experts get few pairs each (decode: a run padded to a larger
    block computes mostly padding, and the weights are read once per block either way);
    larger blocks, fewer weight reads, once every expert gets many (prefill). fp32 dots run on
    FMA units, so smaller tiles keep their operands in registers."""
    pairs_per_expert = num_pairs / num_experts
    block_m = 16 if pairs_per_expert <= 32 else 32 if pairs_per_expert <= 128 else 64
    if dtype == torch.float32:
        return Tiles(block_m, 32, 32, 4, 2)
    if block_m == 64:
        return Tiles(64, 128, 64, 8, 3)
    return Tiles(block_m, 64, 128 if block_m == 16 else 64, 4, 3)


def warm_up_token_counts(max_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> list[int]:
    """The fewest tokens that launch each tile shape a step of up to max_tokens tokens can pick:
    fused_moe run at these counts compiles every kernel variant that serving launches."""
    counts, seen = [], set()
    for tokens in range(1, max_tokens + 1):
        tiles = tile_config(tokens * top_k, num_experts, dtype)
        if tiles not in seen:
            seen.add(tiles)
            counts.append(tokens)
    return counts


@triton.jit
def _tile(pid, num_cols, num_padded_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program pid's block of the sorted layout, its output columns, and whether the routing
    filled that block (programs past the blocks in use have nothing to do)."""
    col_blocks = tl.cdiv(num_cols, BLOCK_N)
    block = pid // col_blocks
    cols = (pid % col_blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    return block, cols, block * BLOCK_M < tl.load(num_padded_ptr)


@triton.jit
def _block_pairs(sorted_pairs_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M: tl.constexpr):
    """The block's pair ids, which of them are pairs rather than padding, and the block's expert."""
    pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    return pairs, pairs < num_pairs, tl.load(expert_ids_ptr + block).to(tl.int64)


# The batch's pair count changes every step: not specialized on, as in the alignment kernel.
@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_pairs_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    top_k,
    hidden,
    inter,
    x_stride,
    w_expert_stride,
    w_row_stride,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # The epilogue rounds gate, up and silu(gate) to the activation dtype, as the reference does.
    block, cols, in_use = _tile(tl.program_id(0), inter, num_padded_ptr, BLOCK_M, BLOCK_N)
    if not in_use:
        return
    pairs, real, expert = _block_pairs(sorted_pairs_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M)
    tokens = pairs // top_k
    col_ok = cols < inter
    gate_rows = w_ptr + expert * w_expert_stride + cols[None, :].to(tl.int64) * w_row_stride
    up_rows = gate_rows + inter * w_row_stride
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        a = tl.load(x_ptr + tokens[:, None] * x_stride + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        gate_w = tl.load(gate_rows + ks[:, None], mask=w_ok, other=0.0)
        up_w = tl.load(up_rows + ks[:, None], mask=w_ok, other=0.0)
        acc_gate = tl.dot(a, gate_w, acc_gate, input_precision=DOT_PRECISION)
        acc_up = tl.dot(a, up_w, acc_up, input_precision=DOT_PRECISION)
    act = out_ptr.dtype.element_ty
    gate = acc_gate.to(act).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
    out = (silu * acc_up.to(act).to(tl.float32)).to(act)
    tl.store(out_ptr + pairs[:, None] * out_stride + cols[None, :], out, mask=real[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    act_ptr,
    w_ptr,
    out_ptr,
    routing_weights_ptr,
    sorted_pairs_ptr,
    expert_ids_ptr,
    num_padded_ptr,
    num_pairs,
    hidden,
    inter,
    act_stride,
    w_expert_stride,
    w_row_stride,
    out_stride,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # The product is rounded to the activation dtype before the routing weight scales it, as in the reference.
    block, cols, in_use = _tile(tl.program_id(0), hidden, num_padded_ptr, BLOCK_M, BLOCK_N)
    if not in_use:
        return
    rows, real, expert = _block_pairs(sorted_pairs_ptr, expert_ids_ptr, block, num_pairs, BLOCK_M)
    col_ok = cols < hidden
    w_rows = w_ptr + expert * w_expert_stride + cols[None, :].to(tl.int64) * w_row_stride
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        a = tl.load(act_ptr + rows[:, None] * act_stride + ks[None, :], mask=real[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + ks[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    act = out_ptr.dtype.element_ty
    routing = tl.load(routing_weights_ptr + rows, mask=real, other=0.0).to(tl.float32)
    out = (acc.to(act).to(tl.float32) * routing[:, None]).to(act)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :], out, mask=real[:, None] & col_ok[None, :])


def check_moe_operands(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor) -> None:
    num_experts, two_inter, hidden_size = w13.shape
    if w2.shape != (num_experts, hidden_size, two_inter // 2) or hidden.shape[-1] != hidden_size:
        raise ValueError(
            f"hidden {tuple(hidden.shape)}, w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} "
            "are not [T, H], [E, 2I, H] and [E, H, I]"
        )
    if not (w13.is_contiguous() and w2.is_contiguous() and hidden.stride(-1) == 1):
        raise ValueError("the expert weights must be contiguous and hidden's rows too")
    if topk_ids.shape[0] != hidden.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} does not route hidden's {hidden.shape[0]} tokens")


def fused_moe_triton(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    check_moe_operands(hidden, w13, w2, topk_ids)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden_size = w13.shape
    inter, num_pairs = two_inter // 2, num_tokens * top_k
    tiles = tile_config(num_pairs, num_experts, hidden.dtype)
    blocks = align_by_expert_triton(topk_ids, num_experts, tiles.block_m)
    act = torch.empty(num_pairs, inter, dtype=hidden.dtype, device=hidden.device)
    rows = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if num_pairs:
        launch_gate_up(hidden, w13, act, blocks, top_k, tiles)
        launch_down(act, w2, rows, topk_weights.reshape(-1).contiguous(), blocks, tiles)
    return rows.view(num_tokens, top_k, hidden_size).sum(1)


def launch_gate_up(
    hidden: torch.Tensor, w13: torch.Tensor, act: torch.Tensor, blocks: ExpertBlocks, top_k: int, tiles: Tiles
) -> None:
    inter = act.shape[1]
    grid = (blocks.expert_ids.numel() * triton.cdiv(inter, tiles.block_n),)
    _gate_up_kernel[grid](
        hidden,
        w13,
        act,
        blocks.sorted_pairs,
        blocks.expert_ids,
        blocks.num_padded,
        act.shape[0],
        top_k,
        hidden.shape[1],
        inter,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(hidden.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def launch_down(
    act: torch.Tensor,
    w2: torch.Tensor,
    rows: torch.Tensor,
    routing_weights: torch.Tensor,
    blocks: ExpertBlocks,
    tiles: Tiles,
) -> None:
    hidden_size = rows.shape[1]
    grid = (blocks.expert_ids.numel() * triton.cdiv(hidden_size, tiles.block_n),)
    _down_kernel[grid](
        act,
        w2,
        rows,
        routing_weights,
        blocks.sorted_pairs,
        blocks.expert_ids,
        blocks.num_padded,
        act.shape[0],
        hidden_size,
        act.shape[1],
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        rows.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        DOT_PRECISION=dot_precision(act.dtype),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )


def fused_moe(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """hidden [T, H] through the experts topk_ids [T, k] (int64) picked for each token, weighted by
    topk_weights [T, k] (hidden's dtype) -> [T, H]. w13 [E, 2I, H] holds each expert's gate rows,
    then its up rows; w2 [E, H, I] its down projection."""
    if use_triton(hidden):
        return fused_moe_triton(hidden, w13, w2, topk_weights, topk_ids)
    return fused_moe_reference(hidden, w13, w2, topk_weights, topk_ids)
