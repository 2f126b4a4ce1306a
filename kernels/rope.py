"""Qwen3's per-head q/k RMSNorm followed by rotary embedding (neox layout)."""
import torch

from kernels.rms_norm import rms_norm_reference


def rope_cos_sin_cache(head_dim: int, max_position: int, theta: float, device=None) -> torch.Tensor:
    """[max_position, head_dim] fp32: cos in the first half, sin in the second."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device=device), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same arithmetic order as transformers: cos/sin cast to the activation dtype.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def qk_norm_rope_reference(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    positions: torch.Tensor, cos_sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D], positions [T]; returns new (q, k)."""
    half = q.shape[-1] // 2
    cs = cos_sin[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    q = _apply_rope(rms_norm_reference(q, q_weight, eps), cos, sin)
    k = _apply_rope(rms_norm_reference(k, k_weight, eps), cos, sin)
    return q, k


def qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin, eps):
    return qk_norm_rope_reference(q, k, q_weight, k_weight, positions, cos_sin, eps)
