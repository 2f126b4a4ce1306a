"""Paged extend (prefill) attention: new tokens over their cached prefix plus each other, causally.

Flash-attention tiles with online softmax. A tile's rows are (token, q head) pairs of one kv
head's group, so each K/V tile is read once for the whole group: a request extending by one
token (a decode inside a mixed step) costs one pass over its context, not one per q head.
Keys every row of the tile sees skip the masks; the causal band is masked; keys past the
tile's last token are never read.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.decode_attention import (
    LOG2E,
    attend_kv_tile,
    cached_values,
    check_paged_cache,
    dot_precision,
    gather_context,
    kv_head_scales,
)
from kernels.fp8 import check_scales, is_fp8


def tile_config(dtype: torch.dtype) -> dict:
    """Tile sizes and launch shape for an input dtype.

    16-bit inputs take the usual Hopper flash-attention shape (128 x 64 tiles, two
    warpgroups); fp32 dots run on FMA units, so smaller tiles keep operands in registers
    (tests/kernels/compile_sm90.py reports registers and spills).
    """
    if dtype == torch.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2}


# Off the CPU the reference attends a block of queries at a time, with a boolean mask over the
# block's visible keys; the block's rows are chosen to keep that mask (and its float form inside
# SDPA) near this many elements, so a long context costs memory in proportion to its length, not its
# square.
MASK_ELEMENTS = 1 << 20
# ...and are a whole number of the splits in which torch's CPU flash attention takes a short
# block's queries: at 30K keys 34 rows cost two splits of 32, the second for 2 rows, as dear as the
# first (a 4,096-token chunk there: 5.0 s of CPU in blocks of 34 rows, 3.0 s in blocks of 32).
QUERY_SPLIT = 32
# torch's CPU flash attention, the kernel F.scaled_dot_product_attention runs on CPU, called for the
# log-sum-exp of each row's scores that it returns beside the output (the public function drops it).
_flash_attention_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def paged_extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, Hq, D] for the new tokens of B requests (cu_seqlens_q [B+1]).

    The new tokens' K/V are already stored in the cache, so request b's keys are
    cache rows [0, prefix_lens[b] + q_len_b) read through page_table[b]. A float8 cache's
    rows are dequantized with k_scale, v_scale [Hk] (kernels/fp8.py). fp32 math: torch's
    fused attention (flash attention on CPU), so the CPU engine's prefill runs it too.
    """
    check_scales(k_cache, k_scale, v_scale)
    out = torch.empty_like(q)
    starts, prefixes = cu_seqlens_q.tolist(), prefix_lens.tolist()
    for b, prefix in enumerate(prefixes):
        lo, hi = starts[b], starts[b + 1]
        k = cached_values(gather_context(k_cache, page_table[b], prefix + hi - lo), k_scale)
        v = cached_values(gather_context(v_cache, page_table[b], prefix + hi - lo), v_scale)
        out[lo:hi] = causal_attention(q[lo:hi], k, v, scale, prefix)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix: int) -> torch.Tensor:
    """q [Lq, Hq, D] over float32 k, v [prefix + Lq, Hk, D]: new token i sees keys [0, prefix + i]."""
    if q.device.type == "cpu":
        return causal_attention_cpu(q, k, v, scale, prefix)
    return causal_attention_in_blocks(q, k, v, scale, prefix)


def causal_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix: int) -> torch.Tensor:
    """causal_attention in two parts merged by their log-sum-exps: the new tokens over their own keys,
    causally, and over the prefix, which every one of them sees whole and so needs no mask. Query
    blocks masked over the prefix (causal_attention_in_blocks) ran torch's CPU kernel at half this
    speed: a 4,096-token chunk after 26,624 tokens 3.3 s of CPU in them, 1.7 s so."""
    if q.shape[0] == 0:  # torch's kernel dies of SIGFPE on no query; the masked blocks make no call for none
        return torch.empty_like(q)
    queries = q.float().transpose(0, 1)[None]  # [1, Hq, Lq, D]
    keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hk, L, D], each for its group of q heads
    out, lse = _flash_attention_cpu(queries, keys[:, :, prefix:], values[:, :, prefix:], is_causal=True, scale=scale)
    if prefix:
        seen, seen_lse = _flash_attention_cpu(queries, keys[:, :, :prefix], values[:, :, :prefix], scale=scale)
        top = torch.maximum(lse, seen_lse)
        own_weight, seen_weight = (lse - top).exp_()[..., None], (seen_lse - top).exp_()[..., None]
        out = out.mul_(own_weight).add_(seen.mul_(seen_weight)).div_(own_weight + seen_weight)
    return out[0].transpose(0, 1).to(q.dtype)


def causal_attention_in_blocks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, prefix: int
) -> torch.Tensor:
    """causal_attention a block of queries at a time, each with its mask over the keys it sees."""
    keys, values = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, Hk, L, D]
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    rows = max(1, MASK_ELEMENTS // k.shape[0])
    if rows > QUERY_SPLIT:
        rows -= rows % QUERY_SPLIT
    for first in range(0, q.shape[0], rows):
        last = min(first + rows, q.shape[0])
        visible = prefix + last  # keys past the block's last token are masked for all of it
        mask = torch.arange(visible, device=q.device) <= prefix + torch.arange(first, last, device=q.device)[:, None]
        block = q[first:last].float().transpose(0, 1)[None]  # [1, Hq, rows, D]
        attended = F.scaled_dot_product_attention(
            block, keys[:, :, :visible], values[:, :, :visible], attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[first:last] = attended[0].transpose(0, 1)
    return out.to(q.dtype)


# The page table's width follows the step's longest sequence: not specialized on, as in the decode kernel.
@triton.jit(do_not_specialize=["page_table_stride"])
def _extend_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    page_table_ptr,
    cu_seqlens_q_ptr,
    prefix_lens_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_token_stride,
    q_head_stride,
    out_token_stride,
    out_head_stride,
    cache_page_stride,
    cache_slot_stride,
    cache_head_stride,
    page_table_stride,
    qk_scale,
    GROUP: tl.constexpr,
    TOKENS_PER_TILE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    tile = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_seqlens_q_ptr + batch)
    q_len = tl.load(cu_seqlens_q_ptr + batch + 1) - q_start
    first_token = tile * TOKENS_PER_TILE
    if first_token >= q_len:
        return
    prefix = tl.load(prefix_lens_ptr + batch)

    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    token = first_token + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_mask = (r < TOKENS_PER_TILE * GROUP) & (token < q_len)
    io_mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    q_rows = (q_start + token).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * q_token_stride + head[:, None] * q_head_stride + d[None, :], mask=io_mask, other=0.0
    )

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    page_row_ptr = page_table_ptr + batch * page_table_stride
    kv_head_offset = kv_head * cache_head_stride
    k_scale, v_scale = kv_head_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8)
    qk_scale = qk_scale * k_scale
    last_key = prefix + token  # new token i sees cache rows [0, prefix + i]
    # Keys [0, prefix + first_token] are visible to every row: whole tiles there need no mask.
    shared_end = (prefix + first_token + 1) // BLOCK_N * BLOCK_N
    kv_end = prefix + tl.minimum(first_token + TOKENS_PER_TILE, q_len)
    for n0 in range(0, shared_end, BLOCK_N):
        m, l, acc = attend_kv_tile(
            q,
            m,
            l,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            page_row_ptr,
            kv_head_offset,
            cache_page_stride,
            cache_slot_stride,
            n0,
            kv_end,
            last_key,
            qk_scale,
            False,
            PAGE_SIZE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            DOT_PRECISION,
        )
    for n0 in range(shared_end, kv_end, BLOCK_N):
        m, l, acc = attend_kv_tile(
            q,
            m,
            l,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            page_row_ptr,
            kv_head_offset,
            cache_page_stride,
            cache_slot_stride,
            n0,
            kv_end,
            last_key,
            qk_scale,
            True,
            PAGE_SIZE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            DOT_PRECISION,
        )
    out = acc * (v_scale / tl.where(l > 0, l, 1.0)[:, None])
    tl.store(
        out_ptr + q_rows[:, None] * out_token_stride + head[:, None] * out_head_stride + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=io_mask,
    )


def paged_extend_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    scale: float,
    max_q_len: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as the reference; max_q_len sizes the grid without a device sync."""
    check_paged_cache(q, k_cache, v_cache)
    check_scales(k_cache, k_scale, v_scale)
    _, num_q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    batch = cu_seqlens_q.shape[0] - 1
    out = torch.empty_like(q)
    if q.shape[0] == 0 or batch == 0 or max_q_len == 0:
        return out
    group = num_q_heads // kv_heads
    config = tile_config(q.dtype)
    if group > config["BLOCK_M"]:
        raise ValueError(f"{group} q heads per kv head exceed the extend tile's {config['BLOCK_M']} rows")
    tokens_per_tile = config["BLOCK_M"] // group
    fp8 = is_fp8(k_cache)
    _extend_kernel[(triton.cdiv(max_q_len, tokens_per_tile), batch, kv_heads)](
        q,
        k_cache,
        v_cache,
        out,
        page_table,
        cu_seqlens_q,
        prefix_lens,
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        scale * LOG2E,
        GROUP=group,
        TOKENS_PER_TILE=tokens_per_tile,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=dot_precision(q.dtype),
        FP8=fp8,
        **config,
    )
    return out


def paged_extend_attention(
    q,
    k_cache,
    v_cache,
    page_table,
    cu_seqlens_q,
    prefix_lens,
    scale,
    max_q_len,
    k_scale=None,
    v_scale=None,
):
    if use_triton(q):
        return paged_extend_attention_triton(
            q, k_cache, v_cache, page_table, cu_seqlens_q, prefix_lens, scale, max_q_len, k_scale, v_scale
        )
    return paged_extend_attention_reference(
        q, k_cache, v_cache, page_table, cu_seqlens_q, prefix_lens, scale, max_q_len, k_scale, v_scale
    )
