"""Write new K/V rows into the paged cache, quantized when the cache is float8 (kernels/fp8.py)."""

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.fp8 import FP8_MAX, check_scales, is_fp8, quantize

_FP8_MAX = tl.constexpr(FP8_MAX)


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v [T, Hk, D]; caches [num_pages, page_size, Hk, D]; slot = page * page_size + offset, -1 skips.

    A float8 cache stores round(k / k_scale) per kv head (scales [Hk] float32); others ignore the scales.
    """
    check_scales(k_cache, k_scale, v_scale)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k, v = k[keep], v[keep]
    if is_fp8(k_cache):
        k, v = quantize(k, k_scale), quantize(v, v_scale)
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    k_token_stride,
    k_head_stride,
    v_token_stride,
    v_head_stride,
    cache_page_stride,
    cache_slot_stride,
    cache_head_stride,
    num_heads,
    head_dim,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    # One token per program, all its kv heads. Skipped tokens (slot -1) are dropped here,
    # so the launch needs no host-side filtering.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_heads) & (cols < head_dim)
    cache_row = (
        (slot // PAGE_SIZE) * cache_page_stride
        + (slot % PAGE_SIZE) * cache_slot_stride
        + heads * cache_head_stride
        + cols
    )
    k = tl.load(k_ptr + token * k_token_stride + heads * k_head_stride + cols, mask=mask)
    v = tl.load(v_ptr + token * v_token_stride + heads * v_head_stride + cols, mask=mask)
    if FP8:
        k = _quantize(k, tl.load(k_scale_ptr + heads, mask=heads < num_heads, other=1.0))
        v = _quantize(v, tl.load(v_scale_ptr + heads, mask=heads < num_heads, other=1.0))
    tl.store(k_cache_ptr + cache_row, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_row, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(x, scale):
    # Correctly rounded division, as torch's: the stored bytes equal the reference's.
    scaled = tl.div_rn(x.to(tl.float32), scale)
    return tl.clamp(scaled, -_FP8_MAX, _FP8_MAX, propagate_nan=tl.PropagateNan.ALL)


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    tokens, num_heads, head_dim = k.shape
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache strides {k_cache.stride()} differ from v_cache strides {v_cache.stride()}")
    check_scales(k_cache, k_scale, v_scale)
    if tokens == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    fp8 = is_fp8(k_cache)
    _store_kv_kernel[(tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale if fp8 else None,
        v_scale if fp8 else None,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_heads,
        head_dim,
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=fp8,
        num_warps=4,
    )


def store_kv(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    if use_triton(k):
        store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_reference(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
