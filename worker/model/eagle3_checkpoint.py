"""Loading an EAGLE-3 head's safetensors into Eagle3Head, and writing random heads in the same
layouts (the tests' and benchmarks' heads, as presets.py writes random Qwen3 checkpoints).

Tensor names, as EAGLE/SpecForge save them (`midlayer.`) or speculators does (`layers.0.`):
fc.weight [hidden, 3 * target hidden]; the layer's input_layernorm, hidden_norm and
post_attention_layernorm; self_attn.{q,k,v,o}_proj (q/k/v over 2 * hidden); mlp.{gate,up,down}_proj;
norm.weight; lm_head.weight [draft vocab, hidden]; d2t [draft vocab] int64 (target id = draft id +
d2t[draft id]; absent when the head drafts over the whole vocabulary); t2d, the inverse map, which
drafting never reads; and embed_tokens.weight, which heads that share the target's embedding leave out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from worker.model.config import CheckpointError
from worker.model.eagle3 import Eagle3Head
from worker.model.eagle3_config import Eagle3Config, read_eagle3_config
from worker.model.loader import SINGLE_FILE, tensor_files

LAYER_PREFIXES = ("midlayer.", "layers.0.")
# Our fused projections -> the checkpoint's, stacked in row order.
FUSED = {
    "midlayer.self_attn.qkv_proj.weight": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "midlayer.gate_up_proj.weight": ("mlp.gate_proj", "mlp.up_proj"),
}
RENAMED = {
    "midlayer.self_attn.o_proj.weight": "self_attn.o_proj",
    "midlayer.down_proj.weight": "mlp.down_proj",
    "midlayer.input_layernorm.weight": "input_layernorm",
    "midlayer.hidden_norm.weight": "hidden_norm",
    "midlayer.post_attention_layernorm.weight": "post_attention_layernorm",
}
OWN = ("fc.weight", "norm.weight", "lm_head.weight")


def load_eagle3_head(
    path: Path, dtype: torch.dtype, device: torch.device, target_embedding: torch.Tensor | None
) -> Eagle3Head:
    """The head at `path`, in `dtype` on `device`. It shares `target_embedding` unless it has its own."""
    config = read_eagle3_config(path)
    tensors = read_tensors(path)
    own_embedding = tensors.pop("embed_tokens.weight", None)
    if own_embedding is None and target_embedding is None:
        raise CheckpointError(
            f"{path}: the head has no embed_tokens.weight of its own, and the model's embedding is split "
            "across tensor-parallel ranks: serve it with one rank, or give the head the model's embedding"
        )
    with torch.device(device):
        head = Eagle3Head(config, dtype, None if own_embedding is not None else target_embedding)
    weights = head_weights(tensors, config, path)
    if own_embedding is not None:
        weights["embed_tokens"] = own_embedding
    state = head.state_dict()
    for name, value in weights.items():
        if state[name].shape != value.shape:
            raise CheckpointError(f"{path}: {name} has shape {tuple(value.shape)}, expected {tuple(state[name].shape)}")
        state[name].copy_(value)
    return head.eval()


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the head, named as EAGLE names them (`midlayer.`, no `model.` prefix)."""
    _, files = tensor_files(path)
    tensors = {}
    for file in sorted(set(files.values())):
        for name, value in load_file(file).items():
            name = name.removeprefix("model.")
            for prefix in LAYER_PREFIXES:
                if name.startswith(prefix):
                    name = "midlayer." + name.removeprefix(prefix)
            tensors[name] = value
    return tensors


def head_weights(tensors: dict[str, torch.Tensor], config: Eagle3Config, path: Path) -> dict[str, torch.Tensor]:
    """Eagle3Head's state-dict entries from the checkpoint's tensors."""

    def take(name: str) -> torch.Tensor:
        if name not in tensors:
            raise CheckpointError(f"{path}: the EAGLE-3 head has no tensor {name}")
        return tensors[name]

    weights = {name: take(name) for name in OWN}
    weights |= {ours: torch.cat([take(f"midlayer.{p}.weight") for p in parts]) for ours, parts in FUSED.items()}
    weights |= {ours: take(f"midlayer.{theirs}.weight") for ours, theirs in RENAMED.items()}
    if "d2t" in tensors:
        weights["d2t"] = tensors["d2t"].long()
    elif config.draft_vocab_size != config.vocab_size:
        raise CheckpointError(f"{path}: a head of {config.draft_vocab_size} draft tokens needs d2t")
    return weights


Layout = Literal["eagle", "speculators"]


def write_random_eagle3_head(
    out_dir: Path,
    target: dict,
    layout: Layout = "eagle",
    draft_vocab_size: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    aux_layer_ids: list[int] | None = None,
    own_embedding: bool = False,
) -> Path:
    """A head for a target of config.json `target` (its hidden size, heads and vocabulary), seeded
    random weights in `layout`'s names and config. Its draft vocabulary is the target's first
    `draft_vocab_size` tokens, each mapped to itself shifted by a seeded permutation through d2t."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab, hidden = target["vocab_size"], target["hidden_size"]
    draft_vocab = draft_vocab_size or vocab
    generator = torch.Generator().manual_seed(seed)
    layer = {
        "hidden_size": hidden,
        "intermediate_size": target["intermediate_size"],
        "num_attention_heads": target["num_attention_heads"],
        "num_key_value_heads": target["num_key_value_heads"],
        "head_dim": target["head_dim"],
        "rms_norm_eps": target.get("rms_norm_eps", 1e-6),
        "rope_theta": target.get("rope_theta", 1000000.0),
        "max_position_embeddings": target.get("max_position_embeddings", 40960),
        "vocab_size": vocab,
        "num_hidden_layers": 1,
        "model_type": "llama",
    }
    (out_dir / "config.json").write_text(json.dumps(head_config(layout, layer, draft_vocab, aux_layer_ids), indent=2))
    tensors = random_head_tensors(read_eagle3_config(out_dir), generator, own_embedding, layout)
    save_file({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, out_dir / SINGLE_FILE)
    return out_dir


def head_config(layout: Layout, layer: dict, draft_vocab: int, aux_layer_ids: list[int] | None) -> dict:
    if layout == "speculators":
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "transformer_layer_config": layer,
            "draft_vocab_size": draft_vocab,
            "norm_before_residual": True,
        }
        return config | ({"eagle_aux_hidden_state_layer_ids": aux_layer_ids} if aux_layer_ids else {})
    config = {"architectures": ["LlamaForCausalLMEagle3"], **layer, "draft_vocab_size": draft_vocab}
    return config | ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}} if aux_layer_ids else {})


def random_head_tensors(
    config: Eagle3Config, generator: torch.Generator, own_embedding: bool, layout: Layout
) -> dict[str, torch.Tensor]:
    h, d = config.hidden_size, config.head_dim
    shapes = {
        "fc.weight": (h, 3 * config.target_hidden_size),
        "self_attn.q_proj.weight": (config.num_attention_heads * d, 2 * h),
        "self_attn.k_proj.weight": (config.num_key_value_heads * d, 2 * h),
        "self_attn.v_proj.weight": (config.num_key_value_heads * d, 2 * h),
        "self_attn.o_proj.weight": (h, config.num_attention_heads * d),
        "mlp.gate_proj.weight": (config.intermediate_size, h),
        "mlp.up_proj.weight": (config.intermediate_size, h),
        "mlp.down_proj.weight": (h, config.intermediate_size),
        "lm_head.weight": (config.draft_vocab_size, h),
    } | ({"embed_tokens.weight": (config.vocab_size, h)} if own_embedding else {})
    prefix = "midlayer." if layout == "eagle" else "layers.0."
    tensors = {
        (prefix + name if name.startswith(("self_attn", "mlp")) else name): 0.05
        * torch.randn(shape, generator=generator)
        for name, shape in shapes.items()
    }
    for norm in ("input_layernorm", "hidden_norm", "post_attention_layernorm"):
        tensors[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=generator)
    tensors["norm.weight"] = 1 + 0.1 * torch.randn(h, generator=generator)
    targets = torch.randperm(config.vocab_size, generator=generator)[: config.draft_vocab_size].sort().values
    tensors["d2t"] = targets - torch.arange(config.draft_vocab_size)
    tensors["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, targets, True)
    return tensors
