"""Paged decode attention: one query token per request over its cached context.

Flash-decoding: each request's context is cut into num_splits ranges that run as separate
programs (so a small batch of long contexts still fills the GPU), each leaving a normalized
partial output and its log-sum-exp; a second kernel merges the splits. A program handles all
the q heads that share one kv head, so each K/V tile is read once per group (GQA).
"""

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.cpu_decode_attention import paged_decode_attention_cpu
from kernels.cpu_decode_attention import supports as cpu_kernel_supports
from kernels.fp8 import check_scales, dequantize, is_fp8

LOG2E = 1.4426950408889634
BLOCK_N = 64  # keys per tile; a tile may span several pages, so each key row finds its own page
MAX_SPLITS = 32  # the merge reads one tile of this many partial results, whatever the split count


def gather_context(
    cache: torch.Tensor,
    page_row: torch.Tensor,
    length: int,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first `length` cached rows of one request, [length, Hk, D].

    With `scratch` (pages, like the cache's) the rows are copied into it and the result is a
    view of it: reusing one buffer for a batch's requests spares a fresh allocation, and on
    CPU its page faults, per request and layer.
    """
    page_size = cache.shape[1]
    pages = page_row[: (length + page_size - 1) // page_size]
    # index_select copies page by page; advanced indexing (`cache[pages]`) was measured slower.
    rows = torch.index_select(cache, 0, pages, out=None if scratch is None else scratch[: len(pages)])
    return rows.flatten(0, 1)[:length]


def cached_values(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Gathered cache rows [L, Hk, D] as float32 values: a float8 cache's dequantized by its scales."""
    return dequantize(rows, scale) if is_fp8(rows) else rows.float()


def paged_decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, Hq, D]; page_table [B, max_pages] int32; context_lens [B] (includes the current token).
    A float8 cache's rows are dequantized with k_scale, v_scale [Hk] (kernels/fp8.py).

    The tests' oracle, and the CPU decode path for 16-bit caches (float32 queries have
    kernels.cpu_decode_attention). Each request's q heads are viewed as [Hk, group, D], so
    every kv head serves its group in place: no per-q-head copy of K/V.
    """
    check_scales(k_cache, k_scale, v_scale)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    out = torch.empty_like(q)
    k_scratch = k_cache.new_empty(page_table.shape[1], *k_cache.shape[1:])
    v_scratch = torch.empty_like(k_scratch)
    for b, length in enumerate(context_lens.tolist()):
        k = cached_values(gather_context(k_cache, page_table[b], length, k_scratch), k_scale)  # [L, Hk, D]
        v = cached_values(gather_context(v_cache, page_table[b], length, v_scratch), v_scale)
        qb = q[b].float().view(num_kv_heads, -1, head_dim)  # [Hk, group, D]
        scores = (qb @ k.permute(1, 2, 0)) * scale  # [Hk, group, L]
        out[b] = (scores.softmax(-1) @ v.transpose(0, 1)).reshape(q.shape[1:]).to(q.dtype)
    return out


@triton.jit
def attend_kv_tile(
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
    MASKED: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of the rows of q over cached keys [n0, n0 + BLOCK_N).

    Scores are in log2 units (qk_scale includes log2 e). Keys at or past kv_end are never
    read; when MASKED, row i sees only keys <= last_key[i] (a tile every row sees whole
    skips that mask). Returns the updated (m, l, acc). A float8 cache's K and V are widened
    to q's dtype, exactly; their scales are the caller's to apply (on qk_scale and on acc).
    """
    n = n0 + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    in_range = n < kv_end
    page = tl.load(page_row_ptr + n // PAGE_SIZE, mask=in_range, other=0).to(tl.int64)
    rows = page * cache_page_stride + (n % PAGE_SIZE) * cache_slot_stride + kv_head_offset
    kv_mask = in_range[:, None] & (d[None, :] < HEAD_DIM)
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        s = tl.where(n[None, :] <= last_key[:, None], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    # A row with nothing visible yet keeps m = -inf; shifting by 0 keeps its p = 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m - m_shift)
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l * alpha + tl.sum(p, axis=1), acc


@triton.jit
def kv_head_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8: tl.constexpr):
    """(k, v) scales of one kv head's float8 values; 1 for a cache that stores values as they are.

    A program attends over one kv head, so its K scale multiplies the scores' scale and its V
    scale the output: the tiles themselves are used as stored.
    """
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(k_scale_ptr + kv_head)
        v_scale = tl.load(v_scale_ptr + kv_head)
    return k_scale, v_scale


# Integers that change from step to step are not specialized on. Triton compiles a variant of a
# kernel for an integer equal to 1 and for one divisible by 16; a variant first met under a
# request would compile there. So one variant serves every batch, and Engine.warm_up compiles it.
@triton.jit(do_not_specialize=["page_table_stride", "num_splits"])
def _decode_split_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    page_table_ptr,
    context_lens_ptr,
    partial_out_ptr,
    partial_lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
    q_batch_stride,
    q_head_stride,
    cache_page_stride,
    cache_slot_stride,
    cache_head_stride,
    page_table_stride,
    num_q_heads,
    num_splits,
    qk_scale,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # Splits cut this request's own context in whole tiles, so no host sync on lengths is needed.
    context_len = tl.load(context_lens_ptr + batch)
    split_len = tl.cdiv(tl.cdiv(context_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, context_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(q_ptr + batch * q_batch_stride + heads[:, None] * q_head_stride + d[None, :], mask=q_mask, other=0.0)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    page_row_ptr = page_table_ptr + batch * page_table_stride
    last_key = tl.full([BLOCK_G], 0, tl.int32) + end - 1
    k_scale, v_scale = kv_head_scales(k_scale_ptr, v_scale_ptr, kv_head, FP8)
    for n0 in range(start, end, BLOCK_N):
        m, l, acc = attend_kv_tile(
            q,
            m,
            l,
            acc,
            k_cache_ptr,
            v_cache_ptr,
            page_row_ptr,
            kv_head * cache_head_stride,
            cache_page_stride,
            cache_slot_stride,
            n0,
            end,
            last_key,
            qk_scale * k_scale,
            True,
            PAGE_SIZE,
            HEAD_DIM,
            BLOCK_N,
            BLOCK_D,
            DOT_PRECISION,
        )
    # An empty split (context shorter than the split start) leaves lse = -inf and weight 0.
    l_safe = tl.where(l > 0, l, 1.0)
    lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
    out = acc * (v_scale / l_safe[:, None])
    part = (batch * num_q_heads + heads) * num_splits + split
    tl.store(partial_lse_ptr + part, lse, mask=g < GROUP)
    tl.store(partial_out_ptr + part[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)


@triton.jit(do_not_specialize=["num_splits"])  # as the split kernel's
def _decode_merge_kernel(
    partial_out_ptr,
    partial_lse_ptr,
    out_ptr,
    out_batch_stride,
    out_head_stride,
    num_q_heads,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    batch = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (batch * num_q_heads + head) * num_splits + s
    lse = tl.load(partial_lse_ptr + part, mask=s < num_splits, other=float("-inf"))
    top = tl.max(lse, axis=0)
    # An empty context leaves every split at -inf: all weights 0 and a zero output, as the reference.
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))
    parts = tl.load(
        partial_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        mask=(s[:, None] < num_splits) & (d[None, :] < HEAD_DIM),
        other=0.0,
    )
    total = tl.sum(weight, axis=0)
    out = tl.sum(weight[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + batch * out_batch_stride + head * out_head_stride + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs get exact fp32 products; tf32 would cost them ~3 decimal digits.
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_stages(dtype: torch.dtype, fp8: bool) -> int:
    # float32 queries over a float8 cache spill registers when the loads run a stage ahead
    # (tests/kernels/compile_sm90.py reports it); every other pairing keeps two stages.
    return 1 if fp8 and dtype == torch.float32 else 2


def check_paged_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache {tuple(k_cache.shape)}/{k_cache.stride()} and v_cache "
            f"{tuple(v_cache.shape)}/{v_cache.stride()} must share shape and strides"
        )
    if k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the kv caches need a contiguous head_dim")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[-2] % k_cache.shape[2] != 0:
        raise ValueError(
            f"q heads x dim {tuple(q.shape[-2:])} do not group over kv cache heads x dim {tuple(k_cache.shape[2:])}"
        )


def decode_num_splits(batch: int, kv_heads: int, max_context: int, device: torch.device) -> int:
    """Enough splits for about two programs per SM, never more than the longest context has tiles."""
    if device.type != "cuda":
        return 3  # the interpreter: a small number that still exercises the merge
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, batch * kv_heads), triton.cdiv(max_context, BLOCK_N), MAX_SPLITS))


def paged_decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as the reference. num_splits defaults to decode_num_splits."""
    check_paged_cache(q, k_cache, v_cache)
    check_scales(k_cache, k_scale, v_scale)
    batch = q.shape[0]
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = decode_num_splits(batch, kv_heads, page_table.shape[1] * page_size, q.device)
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits {num_splits} is outside [1, {MAX_SPLITS}]")
    partial_out, partial_lse = _attend_splits(
        q, k_cache, v_cache, page_table, context_lens, scale, k_scale, v_scale, num_splits
    )
    _merge_splits(partial_out, partial_lse, out)
    return out


def _attend_splits(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    num_splits: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split of each context attended alone: its output and log-sum-exp, in float32, per
    (request, query head, split)."""
    batch, num_q_heads, head_dim = q.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // kv_heads
    partial_out = torch.empty((batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    partial_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    fp8 = is_fp8(k_cache)
    _decode_split_kernel[(batch, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        context_lens,
        partial_out,
        partial_lse,
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        page_table.stride(0),
        num_q_heads,
        num_splits,
        scale * LOG2E,
        GROUP=group,
        PAGE_SIZE=page_size,
        HEAD_DIM=head_dim,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=BLOCK_N,
        BLOCK_D=triton.next_power_of_2(head_dim),
        DOT_PRECISION=dot_precision(q.dtype),
        FP8=fp8,
        num_warps=4,
        num_stages=decode_stages(q.dtype, fp8),
    )
    return partial_out, partial_lse


def _merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> None:
    """The splits' outputs merged into `out` by their log-sum-exps."""
    batch, num_q_heads, num_splits, head_dim = partial_out.shape
    _decode_merge_kernel[(batch, num_q_heads)](
        partial_out,
        partial_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_q_heads,
        num_splits,
        HEAD_DIM=head_dim,
        BLOCK_S=MAX_SPLITS,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )


def paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale, k_scale=None, v_scale=None):
    if use_triton(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, page_table, context_lens, scale, k_scale, v_scale)
    if cpu_kernel_supports(q):
        return paged_decode_attention_cpu(q, k_cache, v_cache, page_table, context_lens, scale, k_scale, v_scale)
    return paged_decode_attention_reference(q, k_cache, v_cache, page_table, context_lens, scale, k_scale, v_scale)
