"""Seeded random LoRA adapters in PEFT's layout (adapter_config.json + adapter_model.safetensors),
for a model's config: what the tests, the benchmark and the demo serve, with no training and no
download. peft reads them as it reads its own (tests/model/test_lora_parity.py loads them into
transformers with peft).

peft starts B at zero, so that a fresh adapter changes nothing; these draw B too, so that each
adapter changes what the model says.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from worker.model.config import Qwen3Config, parse_config
from worker.model.lora_adapter import CONFIG_FILE, PREFIX, WEIGHTS_FILE, matching

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def module_shapes(config: Qwen3Config, module: str) -> tuple[int, int]:
    """(out, in) of a projection of the base model."""
    h, d, heads, kv = config.hidden_size, config.head_dim, config.num_attention_heads, config.num_key_value_heads
    inter = config.intermediate_size
    return {
        "q_proj": (heads * d, h),
        "k_proj": (kv * d, h),
        "v_proj": (kv * d, h),
        "o_proj": (h, heads * d),
        "gate_proj": (inter, h),
        "up_proj": (inter, h),
        "down_proj": (h, inter),
    }[module]


def write_random_adapter(
    out_dir: str | Path,
    base_config: dict[str, Any] | Qwen3Config,
    rank: int,
    target_modules: tuple[str, ...] = ATTENTION + MLP,
    lora_alpha: float | None = None,
    seed: int = 0,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    dtype: torch.dtype = torch.float32,
    std: float = 0.05,
    base_model_name_or_path: str | None = None,
) -> Path:
    """An adapter of `rank` on `target_modules` of every decoder layer (a mixture of experts' sparse
    layers take attention targets only), A and B drawn N(0, std). lora_alpha defaults to 2 * rank."""
    config = base_config if isinstance(base_config, Qwen3Config) else parse_config(base_config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    alpha = float(2 * rank if lora_alpha is None else lora_alpha)
    generator = torch.Generator().manual_seed(seed)
    tensors, written = {}, set()
    for layer in range(config.num_hidden_layers):
        for module in target_modules:
            if module in MLP and config.is_moe_layer(layer):
                continue
            written.add(module)
            parent = "self_attn" if module in ATTENTION else "mlp"
            name = f"model.layers.{layer}.{parent}.{module}"
            r = module_rank(name, rank, rank_pattern or {})
            out_features, in_features = module_shapes(config, module)
            a = torch.randn(r, in_features, generator=generator) * std
            b = torch.randn(out_features, r, generator=generator) * std
            tensors[f"{PREFIX}{name}.lora_A.weight"] = a.to(dtype)
            tensors[f"{PREFIX}{name}.lora_B.weight"] = b.to(dtype)
    save_file(tensors, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(written),
        "use_rslora": use_rslora,
        "rank_pattern": rank_pattern or {},
        "alpha_pattern": alpha_pattern or {},
        "bias": "none",
        "use_dora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "modules_to_save": None,
    }
    (out_dir / CONFIG_FILE).write_text(json.dumps(peft_config, indent=2) + "\n")
    return out_dir


def module_rank(name: str, rank: int, rank_pattern: dict[str, int]) -> int:
    """The rank peft gives module `name`: its rank_pattern entry's, else `rank`."""
    pattern = matching(rank_pattern, name)
    return rank_pattern[pattern] if pattern is not None else rank
