"""Qwen3's per-head q/k RMSNorm followed by rotary embedding (neox layout)."""

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.rms_norm import rms_norm_reference


def rope_inv_freq(head_dim: int, theta: float, device=None) -> torch.Tensor:
    """[head_dim // 2] fp32: plain RoPE's frequency of each rotated pair."""
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))


def rope_cos_sin_table(inv_freq: torch.Tensor, max_position: int, attention_factor: float = 1.0) -> torch.Tensor:
    """[max_position, 2 * len(inv_freq)] fp32: cos in the first half, sin in the second, both
    times attention_factor (YaRN's; both q and k carry it, so the scores carry its square).
    The kernels read positions' rows from this table, so a scaled RoPE costs them nothing."""
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=inv_freq.device), inv_freq)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def rope_cos_sin_cache(head_dim: int, max_position: int, theta: float, device=None) -> torch.Tensor:
    """Plain RoPE's table: [max_position, head_dim] fp32, cos in the first half, sin in the second."""
    return rope_cos_sin_table(rope_inv_freq(head_dim, theta, device), max_position)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic order as transformers: cos/sin cast to the activation dtype.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D], positions [T]; returns new (q, k)."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q = _apply_rope(rms_norm_reference(q, q_weight, eps), cos, sin)
    k = _apply_rope(rms_norm_reference(k, k_weight, eps), cos, sin)
    return q, k


@triton.jit
def _head_norm_rope_kernel(
    x_ptr,
    weight_ptr,
    positions_ptr,
    cos_sin_ptr,
    out_ptr,
    x_token_stride,
    x_head_stride,
    out_token_stride,
    out_head_stride,
    cos_sin_stride,
    num_heads,
    eps,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    # One token per program, all its heads at once; each head row is split into the
    # two halves that neox rotary pairs up. Every product is rounded to the output
    # dtype before the next op, because the reference computes in that dtype.
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    x_row = x_ptr + token * x_token_stride + heads * x_head_stride + cols
    x1 = tl.load(x_row, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + HALF, mask=mask, other=0.0).to(tl.float32)

    rstd = tl.div_rn(1.0, tl.sqrt_rn((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps))
    x_dtype = x_ptr.dtype.element_ty
    act = out_ptr.dtype.element_ty
    w1 = tl.load(weight_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)
    n1 = ((x1 * rstd[:, None]).to(x_dtype).to(tl.float32) * w1).to(act).to(tl.float32)
    n2 = ((x2 * rstd[:, None]).to(x_dtype).to(tl.float32) * w2).to(act).to(tl.float32)

    position = tl.load(positions_ptr + token)
    cs_row = cos_sin_ptr + position * cos_sin_stride + cols
    cos = tl.load(cs_row, mask=cols < HALF, other=0.0).to(act).to(tl.float32)
    sin = tl.load(cs_row + HALF, mask=cols < HALF, other=0.0).to(act).to(tl.float32)
    o1 = (n1 * cos).to(act).to(tl.float32) - (n2 * sin).to(act).to(tl.float32)
    o2 = (n2 * cos).to(act).to(tl.float32) + (n1 * sin).to(act).to(tl.float32)
    out_row = out_ptr + token * out_token_stride + heads * out_head_stride + cols
    tl.store(out_row, o1.to(act), mask=mask)
    tl.store(out_row + HALF, o2.to(act), mask=mask)


def _head_norm_rope(x, weight, positions, cos_sin, eps) -> torch.Tensor:
    tokens, num_heads, head_dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if tokens == 0:
        return out
    half = head_dim // 2
    _head_norm_rope_kernel[(tokens,)](
        x,
        weight,
        positions,
        cos_sin,
        out,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos_sin.stride(0),
        num_heads,
        eps,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return out


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as the reference; q and k may be strided views (e.g. split from fused qkv)."""
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    return (
        _head_norm_rope(q, q_weight, positions, cos_sin, eps),
        _head_norm_rope(k, k_weight, positions, cos_sin, eps),
    )


def qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin, eps):
    if use_triton(q):
        return qk_norm_rope_triton(q, k, q_weight, k_weight, positions, cos_sin, eps)
    return qk_norm_rope_reference(q, k, q_weight, k_weight, positions, cos_sin, eps)
