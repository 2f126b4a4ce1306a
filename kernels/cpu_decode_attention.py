"""Paged decode attention for float32 queries on CPU, compiled by numba: the CPU engine's decode path.

The torch reference has to copy each request's pages into one contiguous buffer before its
matmuls, and with a single query row per kv-head group those matmuls are memory-bound too;
on the `small` preset the copy was about half of the reference's time. This kernel reads each
cached K and V row in place, straight from its page: one pass over K for the scores, one
over V for the weighted sum, so a step costs about one read of the batch's cached K/V (which
is what bounds it: a layer's cache outgrows the L3). Requests are spread over torch's thread
count (bench/RESULTS.md has what it measured against the reference). Math is fp32, like the
reference's.

A float8 cache (kernels/fp8.py) is read as bytes, each decoded through a 256-entry table
(exact), with its per-kv-head scales applied to the scores and to the output: a quarter of
a float32 cache's bytes per step.
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


def _cached(row, d, table):  # pragma: no cover - the overload below is what compiles
    raise NotImplementedError


@overload(_cached, jit_options={"fastmath": FASTMATH})
def _cached_overload(row, d, table):
    """Element d of a cached row: a float stored as is, or a float8 byte looked up in the table."""
    if isinstance(row.dtype, types.Integer):
        return lambda row, d, table: table[row[d]]
    return lambda row, d, table: row[d]


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True, parallel=True)
def _decode(q, k_cache, v_cache, page_table, context_lens, scale, k_scales, v_scales, table, out):  # pragma: no cover
    for b in numba.prange(q.shape[0]):
        _attend(q[b], k_cache, v_cache, page_table[b], context_lens[b], scale, k_scales, v_scales, table, out[b])


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True)
def _attend(q, k_cache, v_cache, pages, length, scale, k_scales, v_scales, table, out):  # pragma: no cover
    """One request's q heads [Hq, D] over its first `length` cached rows.

    Each cached row [Hk, D] is read once for all the q heads, contiguously: work items of one
    (request, kv head) each, which read the rows in strided pieces, made decode attention slower
    over bench/offline.py's run."""
    num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    weights = np.empty((num_q_heads, length), dtype=np.float32)
    for t0 in range(0, length, page_size):
        k_page = k_cache[pages[t0 // page_size]]  # [page_size, Hk, D]
        for s in range(min(page_size, length - t0)):
            for kv_head in range(num_kv_heads):
                k_row = k_page[s, kv_head]
                row_scale = scale * k_scales[kv_head]
                for h in range(kv_head * group, (kv_head + 1) * group):
                    q_row = q[h]
                    dot = np.float32(0.0)
                    for d in range(head_dim):
                        dot += q_row[d] * _cached(k_row, d, table)
                    weights[h, t0 + s] = dot * row_scale
    for h in range(num_q_heads):
        _softmax_in_place(weights[h])
    acc = np.zeros((num_q_heads, head_dim), dtype=np.float32)
    for t0 in range(0, length, page_size):
        v_page = v_cache[pages[t0 // page_size]]
        for s in range(min(page_size, length - t0)):
            for kv_head in range(num_kv_heads):
                v_row = v_page[s, kv_head]
                for h in range(kv_head * group, (kv_head + 1) * group):
                    w = weights[h, t0 + s]
                    for d in range(head_dim):
                        acc[h, d] += w * _cached(v_row, d, table)
    for h in range(num_q_heads):
        v_scale = v_scales[h // group]
        for d in range(head_dim):
            out[h, d] = acc[h, d] * v_scale


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True)
def _softmax_in_place(x):  # pragma: no cover - compiled
    if x.size == 0:
        return
    peak = x[0]
    for i in range(1, x.size):
        peak = max(peak, x[i])
    total = np.float32(0.0)
    for i in range(x.size):
        x[i] = np.exp(x[i] - peak)
        total += x[i]
    for i in range(x.size):
        x[i] /= total


def supports(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype == torch.float32


def paged_decode_attention_cpu(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
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
        q.numpy(), k_cache.numpy(), v_cache.numpy(), page_table.numpy(), context_lens.numpy(),
        np.float32(scale), k_scales, v_scales, table, out.numpy(),
    )
    return out
