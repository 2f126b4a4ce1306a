"""RMSNorm (with and without the residual add) and Qwen3's q/k norm + RoPE for float32 on CPU,
compiled by numba.

Each torch reference is a chain of element-wise ops (about seven for a norm, fifteen for the
q/k norm and rotary), and every one of them reads and writes the whole activation. These do
one pass per row, rows spread over torch's thread count. The arithmetic is the reference's,
in its order; only the sum of squares is reassociated (vectorized), so results differ from
the reference in the last bits only.
"""
import numba
import numpy as np
import torch

from kernels._numba import FASTMATH, use_torch_thread_count


@numba.njit(fastmath=FASTMATH, inline="always", nogil=True)
def _normalize(x, weight, eps, out):  # pragma: no cover - compiled
    """out = weight * (x / sqrt(mean(x**2) + eps)), as rms_norm_reference rounds it."""
    squares = np.float32(0.0)
    for i in range(x.size):
        squares += x[i] * x[i]
    inverse = np.float32(1.0) / np.sqrt(squares / np.float32(x.size) + eps)
    for i in range(x.size):
        out[i] = weight[i] * (x[i] * inverse)


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True, parallel=True)
def _rms_norm(x, weight, eps, out):  # pragma: no cover - compiled
    for row in numba.prange(x.shape[0]):
        _normalize(x[row], weight, eps, out[row])


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True, parallel=True)
def _add_rms_norm(x, residual, weight, eps, out, residual_out):  # pragma: no cover - compiled
    for row in numba.prange(x.shape[0]):
        total = residual_out[row]
        for i in range(total.size):
            total[i] = x[row, i] + residual[row, i]
        _normalize(total, weight, eps, out[row])


@numba.njit(fastmath=FASTMATH, inline="always", nogil=True)
def _norm_rope_heads(x, weight, cos, sin, eps, out):  # pragma: no cover - compiled
    """x, out [heads, head_dim]: each head normed, then rotated (neox halves)."""
    half = x.shape[1] // 2
    normed = np.empty(x.shape[1], dtype=np.float32)
    for h in range(x.shape[0]):
        _normalize(x[h], weight, eps, normed)
        for i in range(half):
            first, second = normed[i], normed[half + i]
            out[h, i] = first * cos[i] - second * sin[i]
            out[h, half + i] = second * cos[i] + first * sin[i]


@numba.njit(fastmath=FASTMATH, cache=True, nogil=True, parallel=True)
def _qk_norm_rope(q, k, q_weight, k_weight, positions, cos_sin, eps, q_out, k_out):  # pragma: no cover - compiled
    half = q.shape[2] // 2
    for t in numba.prange(q.shape[0]):
        cos, sin = cos_sin[positions[t], :half], cos_sin[positions[t], half:]
        _norm_rope_heads(q[t], q_weight, cos, sin, eps, q_out[t])
        _norm_rope_heads(k[t], k_weight, cos, sin, eps, k_out[t])


def supports(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(x2)
    use_torch_thread_count()
    _rms_norm(x2.numpy(), weight.contiguous().numpy(), np.float32(eps), out.numpy())
    return out.view(x.shape)


def fused_add_rms_norm_cpu(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    residual2 = residual.reshape(-1, x.shape[-1]).contiguous()
    out, residual_out = torch.empty_like(x2), torch.empty_like(x2)
    use_torch_thread_count()
    _add_rms_norm(
        x2.numpy(), residual2.numpy(), weight.contiguous().numpy(), np.float32(eps), out.numpy(), residual_out.numpy()
    )
    return out.view(x.shape), residual_out.view(x.shape)


def qk_norm_rope_cpu(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    positions: torch.Tensor, cos_sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D], positions [T]; returns new (q, k)."""
    q, k = q.contiguous(), k.contiguous()
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    use_torch_thread_count()
    _qk_norm_rope(
        q.numpy(), k.numpy(), q_weight.contiguous().numpy(), k_weight.contiguous().numpy(),
        positions.contiguous().numpy(), cos_sin.contiguous().numpy(), np.float32(eps), q_out.numpy(), k_out.numpy(),
    )
    return q_out, k_out
