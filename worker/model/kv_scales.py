"""Scales for a float8 KV cache, derived from the weights: no K or V value the model can compute
lies outside e4m3's range, and no calibration data is needed.

K: Qwen3 RMS-normalizes each key head (k_norm) before RoPE, so the normalized vector has
L2 norm at most sqrt(head_dim) before its weight w; RoPE rotates pairs of elements and YaRN
multiplies cos and sin by its attention factor a, so |k_i| <= a * sqrt(head_dim) * max|w|.
V: v_j = sum_i n_i (w_i W_ji), where n is the RMS-normalized hidden state (L2 norm at most
sqrt(hidden)) and w the input norm's weight, so |v_j| <= sqrt(hidden) * ||w * W_j||_2
(Cauchy-Schwarz); a head's bound is its rows' largest.

A scale is its bound over e4m3's largest value (448), rounded up to a power of two, so that
quantizing divides exactly and dequantizing multiplies exactly, in every kernel alike. The
kernels also clamp, so a value past the bound (bf16 rounding) is saturated, never NaN.
"""

import math

import torch
from torch import nn

from kernels.fp8 import FP8_MAX


def fp8_kv_scales_per_head(layer: nn.Module, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale), each [num_kv_heads] float32: one decoder layer's bounds, per kv head."""
    attn = layer.self_attn
    k_bound = attention_factor * math.sqrt(attn.head_dim) * attn.k_norm.weight.float().abs().max()
    v_rows = attn.qkv_proj.weight[attn.q_size + attn.kv_size :].float()  # [Hk * D, hidden]
    hidden = v_rows.shape[1]
    row_bounds = math.sqrt(hidden) * (v_rows * layer.input_layernorm.weight.float()).norm(dim=1)
    v_bound = row_bounds.view(attn.num_kv_heads, attn.head_dim).amax(dim=1)
    return power_of_two_scale(k_bound.expand(attn.num_kv_heads)), power_of_two_scale(v_bound)


def power_of_two_scale(bound: torch.Tensor) -> torch.Tensor:
    """The smallest power of two s with bound / s <= FP8_MAX (a zero bound: 1)."""
    exponent = torch.ceil(torch.log2(bound.float() / FP8_MAX))
    return torch.where(bound > 0, torch.exp2(exponent), torch.ones_like(bound)).float().contiguous()


def use_fp8_kv_scales(model: nn.Module) -> None:
    """Sets every layer's k_scale and v_scale for a float8 KV cache."""
    rope = model.config.rope_scaling
    attention_factor = rope.cos_sin_attention_factor() if rope is not None else 1.0
    for layer in model.model.layers:
        k_scale, v_scale = fp8_kv_scales_per_head(layer, attention_factor)
        layer.self_attn.k_scale.copy_(k_scale)
        layer.self_attn.v_scale.copy_(v_scale)
