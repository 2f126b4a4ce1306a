"""The FP8 KV cache's number format: float8 e4m3 (OCP's E4M3FN, torch.float8_e4m3fn) with one
float32 scale per kv head, stored value = round(x / scale).

Every kernel takes the scales as a [num_kv_heads] vector, so per-tensor scales are the same
vector with one value repeated (worker/model/kv_scales.py chooses the values). A cache in any
other dtype stores values as they are and its kernels never read the scales.
"""

import torch

FP8_DTYPE = torch.float8_e4m3fn
# The format's largest finite value. It has no infinity: torch turns anything past this into
# NaN, so values are clamped first (NaN itself stays NaN, as the sampler's check relies on).
FP8_MAX = torch.finfo(FP8_DTYPE).max


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., Hk, D] in any float dtype -> float8 e4m3, rounded to nearest even after x / scale."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Stored float8 rows [..., Hk, D] -> float32 values."""
    return x.float() * scale[:, None]


def check_scales(cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if not is_fp8(cache):
        return
    heads = cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None or scale.shape != (heads,) or scale.dtype != torch.float32:
            got = None if scale is None else f"{tuple(scale.shape)} {scale.dtype}"
            raise ValueError(f"a float8 KV cache needs {name} as a float32 [{heads}] vector, got {got}")
