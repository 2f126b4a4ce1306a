"""Paged decode attention for float32 queries on CPU, compiled by numba: the CPU engine's decode path.

The torch reference has to copy each request's pages into one contiguous buffer before its
matmuls, and with a single query row per kv-head group those matmuls are memory-bound too;
on the `small` preset the copy was about half of the reference's time. This kernel reads each
cached K and V row in place, straight from its page: one pass over K for the scores, one
over V for the weighted sum, so a step costs about one read of the batch's cached K/V (which
is what bounds it: a layer's cache outgrows the L3). Requests are spread over torch's thread
count (bench/RESULTS.md has what it measured against the reference). Math is fp32, like the
reference's.

A float8 cache (kernels/fp8.py) is read as bytes, each row decoded through a 256-entry table
(exact) into a small buffer, with its per-kv-head scales applied to the scores and to the
output: a quarter of a float32 cache's bytes per step, at the cost of the lookups.
"""

import numba
import numpy as np
import torch
from numba import types
from numba.extending import overload

from kernels._numba import FASTMATH, use_torch_thread_count
from kernels.fp8 import FP8_DTYPE, check_scales, is_fp8

# Every float8 e4m3 byte's value (NaN's bytes included), for the kernel's table lookups.
FP8_VALUES = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float().numpy()
NO_TABLE = np.empty(0, dtype=np.float32)
# A context is attended in pieces of this many tokens, one work item each: enough to keep a
# batch's short requests whole (no merge to pay for), and to give a lone long one to every thread.
SPLIT_TOKENS = 2048


def _row_values(row, table, buffer):  # pragma: no cover - the overload below is what compiles
    raise NotImplementedError


@overload(_row_values, jit_options={"fastmath": FASTMATH})
def _row_values_overload(row, table, buffer):
    """A cached row's values: a float row as it is, or a float8 row's bytes looked up in the
    table into `buffer` (once per row and kv head, so the dot products over it vectorize)."""
    if isinstance(row.dtype, types.Integer):

        def lookup(row, table, buffer):
            for d in range(row.size):
                buffer[d] = table[row[d]]
            return buffer

        return lookup
    return lambda row, table, buffer: row


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True, parallel=True)
def _decode(
    q, k_cache, v_cache, page_table, context_lens, scale, k_scales, v_scales, table, split, out
):  # pragma: no cover
    """Each request's context is cut into pieces of `split` tokens, one work item each, so a
    lone long request still spreads over the threads; each item leaves its softmax's peak, sum
    and unnormalized output, and a second pass merges a request's items."""
    batch, num_q_heads, head_dim = q.shape
    first_item = np.zeros(batch + 1, dtype=np.int64)
    for b in range(batch):
        first_item[b + 1] = first_item[b] + max(1, (context_lens[b] + split - 1) // split)
    items = first_item[batch]
    peaks = np.empty((items, num_q_heads), dtype=np.float32)
    sums = np.empty((items, num_q_heads), dtype=np.float32)
    accs = np.empty((items, num_q_heads, head_dim), dtype=np.float32)
    for i in numba.prange(items):
        b = np.searchsorted(first_item, i, side="right") - 1
        start = (i - first_item[b]) * split
        end = min(start + split, context_lens[b])
        _attend(q[b], k_cache, v_cache, page_table[b], start, end, scale, k_scales, table, peaks[i], sums[i], accs[i])
    # Serially: a few operations per head and item, less than a second parallel region's start costs.
    for b in range(batch):
        _merge(peaks, sums, accs, first_item[b], first_item[b + 1], v_scales, out[b])


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True)
def _attend(q, k_cache, v_cache, pages, start, end, scale, k_scales, table, peak, total, acc):  # pragma: no cover
    """One request's q heads [Hq, D] over its cached rows [start, end): per head, the scores'
    peak, the sum of exp(score - peak), and the exp-weighted sum of V rows (unnormalized).

    Each cached row [Hk, D] is read once for all the q heads, contiguously: work items of one
    (request, kv head) each, which read the rows in strided pieces, made decode attention slower
    over bench/offline.py's run."""
    num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    length = end - start
    weights = np.empty((num_q_heads, length), dtype=np.float32)
    buffer = np.empty(head_dim, dtype=np.float32)
    for t in range(start, end):
        k_rows = k_cache[pages[t // page_size], t % page_size]  # [Hk, D]
        for kv_head in range(num_kv_heads):
            k_row = _row_values(k_rows[kv_head], table, buffer)
            row_scale = scale * k_scales[kv_head]
            for h in range(kv_head * group, (kv_head + 1) * group):
                q_row = q[h]
                dot = np.float32(0.0)
                for d in range(head_dim):
                    dot += q_row[d] * k_row[d]
                weights[h, t - start] = dot * row_scale
    for h in range(num_q_heads):
        peak[h], total[h] = _exp_in_place(weights[h])
    acc[:] = 0.0
    for t in range(start, end):
        v_rows = v_cache[pages[t // page_size], t % page_size]
        for kv_head in range(num_kv_heads):
            v_row = _row_values(v_rows[kv_head], table, buffer)
            for h in range(kv_head * group, (kv_head + 1) * group):
                w = weights[h, t - start]
                for d in range(head_dim):
                    acc[h, d] += w * v_row[d]


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True)
def _exp_in_place(x):  # pragma: no cover - compiled
    """x -> exp(x - peak); returns (peak, sum). An empty x gives (-inf, 0)."""
    peak = np.float32(-np.inf)
    for i in range(x.size):
        peak = max(peak, x[i])
    total = np.float32(0.0)
    for i in range(x.size):
        x[i] = np.exp(x[i] - peak)
        total += x[i]
    return peak, total


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True)
def _merge(peaks, sums, accs, first, last, v_scales, out):  # pragma: no cover - compiled
    """One request's items [first, last) -> its normalized output, V's scale applied; an empty
    context gives zeros, as the reference's softmax over no keys."""
    num_q_heads, head_dim = out.shape
    group = num_q_heads // v_scales.size
    for h in range(num_q_heads):
        top = np.float32(-np.inf)
        for i in range(first, last):
            top = max(top, peaks[i, h])
        total = np.float32(0.0)
        for d in range(head_dim):
            out[h, d] = 0.0
        for i in range(first, last):
            if sums[i, h] == 0.0:
                continue  # an item that saw no keys
            weight = np.exp(peaks[i, h] - top)
            total += weight * sums[i, h]
            for d in range(head_dim):
                out[h, d] += weight * accs[i, h, d]
        scale = v_scales[h // group] / total if total > 0 else np.float32(0.0)
        for d in range(head_dim):
            out[h, d] *= scale


def supports(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32


def paged_decode_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as paged_decode_attention_reference, for float32 queries on CPU."""
    check_scales(k_cache, k_scale, v_scale)
    q = q.contiguous()
    out = torch.empty_like(q)
    if is_fp8(k_cache):
        k_cache, v_cache, table = k_cache.view(torch.uint8), v_cache.view(torch.uint8), FP8_VALUES
        k_scales, v_scales = k_scale.numpy(), v_scale.numpy()
    else:
        table = NO_TABLE
        k_scales = v_scales = np.ones(k_cache.shape[2], dtype=np.float32)
    use_torch_thread_count()
    _decode(
        q.numpy(),
        k_cache.numpy(),
        v_cache.numpy(),
        page_table.numpy(),
        context_lens.numpy(),
        np.float32(scale),
        k_scales,
        v_scales,
        table,
        SPLIT_TOKENS,
        out.numpy(),
    )
    return out
