"""Load a Hugging Face-layout Qwen3 or Qwen3-MoE checkpoint into Qwen3ForCausalLM.

safetensors files are memory-mapped and read one tensor at a time straight into the
model's (uninitialized) parameters, so peak memory is the model plus one tensor.
"""
import logging
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import SafetensorError, safe_open

from producer_client.errors import InvalidArgument
from worker.model.config import DTYPES, CheckpointError, GenerationConfig, Qwen3Config, read_json
from worker.model.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_NAMES = {**DTYPES, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LoadedModel(NamedTuple):
    model: Qwen3ForCausalLM
    config: Qwen3Config
    generation_config: GenerationConfig


def load_model(
    path: str | Path, dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu"
) -> LoadedModel:
    """dtype: float32/bfloat16/float16 (or fp32/bf16/fp16); None means config.json's torch_dtype."""
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: checkpoint directory not found")
    config = Qwen3Config.from_file(ckpt / "config.json")
    generation_config = GenerationConfig.from_dir(ckpt, config)
    source, files = tensor_files(ckpt)
    with torch.device(device):
        model = Qwen3ForCausalLM(config, resolve_dtype(dtype, config))
    load_weights(model, source, files)
    log.info(
        "loaded %s: %d layers, %s, %s on %s", ckpt, config.num_hidden_layers, describe_parameters(model),
        model.model.norm.weight.dtype, device,
    )
    return LoadedModel(model.eval(), config, generation_config)


def describe_parameters(model: Qwen3ForCausalLM) -> str:
    """'N parameters', and for a mixture of experts how many are experts' and how many a token uses."""
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    if not experts:
        return f"{total / 1e6:.1f}M parameters"
    config = model.config
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    return f"{total / 1e6:.1f}M parameters ({experts / 1e6:.1f}M in experts, {active / 1e6:.1f}M active per token)"


def resolve_dtype(dtype: torch.dtype | str | None, config: Qwen3Config) -> torch.dtype:
    if dtype is None:
        return config.dtype
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype in DTYPE_NAMES:
        return DTYPE_NAMES[dtype]
    raise InvalidArgument("dtype", f"{dtype!r} is not one of {', '.join(DTYPE_NAMES)}")


def tensor_files(ckpt: Path) -> tuple[Path, dict[str, Path]]:
    """(the file that lists the tensors, {checkpoint tensor name: safetensors file holding it})."""
    single, index = ckpt / SINGLE_FILE, ckpt / INDEX_FILE
    if single.is_file():
        with open_safetensors(single) as f:
            return single, dict.fromkeys(f.keys(), single)
    if not index.is_file():
        raise CheckpointError(f"{ckpt}: no weights file ({SINGLE_FILE} or {INDEX_FILE}) found")
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: has no weight_map object")
    files = {name: ckpt / shard for name, shard in weight_map.items()}
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard named in {index.name} not found")
    return index, files


def open_safetensors(path: Path):
    try:
        return safe_open(path, framework="pt")
    except SafetensorError as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def fused_parts(config: Qwen3Config) -> dict[str, list[tuple[str, int]]]:
    """Our fused projections -> the checkpoint projections stacked in them: (name, rows), in row order."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
        "gate_up_proj": [("gate_proj", inter), ("up_proj", inter)],
    }


def checkpoint_targets(model: Qwen3ForCausalLM) -> dict[str, torch.Tensor]:
    """Each checkpoint tensor name -> the parameter, or rows of a fused parameter, it fills.

    Parameter names are transformers' names except for the fused projections, so the
    checkpoint's layout (and expected shapes) is derived from the model, not written twice.
    """
    parts = fused_parts(model.config)
    targets = {}
    for name, param in model.named_parameters():
        module, leaf = name.rsplit(".", 1)
        parent, _, proj = module.rpartition(".")
        if proj == "experts":
            targets.update(expert_targets(module, leaf, param.data))
            continue
        if proj not in parts:
            targets[name] = param.data
            continue
        names, rows = zip(*parts[proj])
        for part, view in zip(names, param.data.split(rows), strict=True):
            targets[f"{parent}.{part}.{leaf}"] = view
    return targets


def expert_targets(module: str, leaf: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """A MoE layer's stacked expert weight -> the per-expert checkpoint tensors it holds, as
    Hugging Face checkpoints name them: gate_up_proj [E, 2I, H] is each expert's gate_proj rows,
    then its up_proj rows; down_proj [E, H, I] each expert's down_proj."""
    parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}[leaf]
    return {
        f"{module}.{expert}.{part}.weight": view
        for expert, weight in enumerate(stacked)
        for part, view in zip(parts, weight.chunk(len(parts)), strict=True)
    }


def load_weights(model: Qwen3ForCausalLM, source: Path, files: dict[str, Path]) -> None:
    targets = checkpoint_targets(model)
    missing = [name for name in targets if name not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]}{more}")
    unused = sorted(set(files) - set(targets))
    if unused:
        log.warning("%s: ignoring %d tensors the model does not use: %s", source, len(unused), ", ".join(unused[:8]))
    by_file = defaultdict(list)
    for name in targets:
        by_file[files[name]].append(name)
    for path, names in by_file.items():
        with open_safetensors(path) as f:
            for name in names:
                copy_tensor(f, name, targets[name], path)


def copy_tensor(f, name: str, dest: torch.Tensor, path: Path) -> None:
    shape = list(f.get_slice(name).get_shape())
    if shape != list(dest.shape):
        raise CheckpointError(
            f"{path}: tensor {name} has shape {shape}, expected {list(dest.shape)} from config.json"
        )
    dest.copy_(f.get_tensor(name))
