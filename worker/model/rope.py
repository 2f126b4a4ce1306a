"""RoPE as config.json sets it: plain, or YaRN-scaled (Qwen3's published way past 32,768 tokens).

YaRN (Peng et al. 2023, arXiv:2309.00071) keeps the fast-rotating pairs as trained
(extrapolation), slows the slow ones down by `factor` (interpolation), blends the pairs in
between on a linear ramp over the dimensions that turn between `beta_slow` and `beta_fast`
times within the original window, and multiplies cos and sin by an attention factor. The
arithmetic follows transformers' `_compute_yarn_parameters` step by step, so the tables are
equal to the last bit. `rope_scaling` (or transformers 5's `rope_parameters`) of any other
type is refused at load by worker.model.config.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt

from kernels.rope import rope_cos_sin_table, rope_inv_freq


class YarnScaling(BaseModel):
    """config.json's YaRN parameters, with transformers' defaults for those left out."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    rope_type: Literal["yarn"]
    factor: float = Field(ge=1.0)
    original_max_position_embeddings: PositiveInt
    attention_factor: PositiveFloat | None = None
    beta_fast: PositiveFloat = 32.0
    beta_slow: PositiveFloat = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @property
    def context_length(self) -> int:
        """Positions the scaled model serves: the original window times the factor (as vLLM derives it)."""
        return int(self.original_max_position_embeddings * self.factor)

    def cos_sin_attention_factor(self) -> float:
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def inv_freq(self, head_dim: int, theta: float) -> torch.Tensor:
        base_powers = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        extrapolated = 1.0 / base_powers
        interpolated = 1.0 / (self.factor * base_powers)
        low, high = self._blended_pairs(head_dim, theta)
        keep = 1 - linear_ramp(low, high, head_dim // 2)  # 1: the pair rotates as trained
        return interpolated * (1 - keep) + extrapolated * keep

    def _blended_pairs(self, head_dim: int, theta: float) -> tuple[float, float]:
        """The range of pair indices between full extrapolation and full interpolation."""
        low = pair_turning(self.beta_fast, head_dim, theta, self.original_max_position_embeddings)
        high = pair_turning(self.beta_slow, head_dim, theta, self.original_max_position_embeddings)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def pair_turning(rotations: float, head_dim: int, theta: float, window: int) -> float:
    """The (fractional) pair index whose angle turns `rotations` times over `window` positions."""
    return (head_dim * math.log(window / (rotations * 2 * math.pi))) / (2 * math.log(theta))


def linear_ramp(low: float, high: float, size: int) -> torch.Tensor:
    if low == high:
        high += 0.001  # as transformers: a ramp of one step, not a division by zero
    return torch.clamp((torch.arange(size, dtype=torch.float32) - low) / (high - low), 0, 1)


def rope_table(
    head_dim: int,
    theta: float,
    max_position: int,
    scaling: YarnScaling | None,
    device=None,
) -> torch.Tensor:
    """The cos/sin table the rope kernel reads: [max_position, head_dim] fp32."""
    if scaling is None:
        return rope_cos_sin_table(rope_inv_freq(head_dim, theta, device), max_position)
    inv_freq = scaling.inv_freq(head_dim, theta).to(device)
    return rope_cos_sin_table(inv_freq, max_position, scaling.cos_sin_attention_factor())
