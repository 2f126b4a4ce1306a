"""Load a Hugging Face-layout Qwen3 or Qwen3-MoE checkpoint into Qwen3ForCausalLM.

Each tensor is read straight into the model's (uninitialized) parameters, and a
tensor-parallel rank reads only its share of each (worker/model/safetensors_file.py): peak
memory is the rank's share of the model, plus one block when a dtype is converted or columns
are picked out of rows.
"""

import logging
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from producer_client.errors import InvalidArgument
from worker.model.config import DTYPES, CheckpointError, GenerationConfig, Qwen3Config, read_json
from worker.model.parallel import SINGLE, TensorParallel
from worker.model.qwen3 import Qwen3ForCausalLM
from worker.model.safetensors_file import SafetensorsFile

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DTYPE_NAMES = {**DTYPES, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class LoadedModel(NamedTuple):
    model: Qwen3ForCausalLM
    config: Qwen3Config
    generation_config: GenerationConfig


class Target(NamedTuple):
    """Where one checkpoint tensor goes: this rank's rows of it (and only some of each row's
    columns, for a row-parallel weight) fill `dest`; `shape` is the whole tensor's."""

    dest: torch.Tensor
    shape: tuple[int, ...]
    rows: range
    cols: range | None = None


def load_model(
    path: str | Path,
    dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """dtype: float32/bfloat16/float16 (or fp32/bf16/fp16); None means config.json's torch_dtype.
    `tp`: a tensor-parallel rank builds and reads only its share of the model."""
    ckpt, config, generation_config = read_configs(path)
    source, files = tensor_files(ckpt)
    with torch.device(device):
        model = Qwen3ForCausalLM(config, resolve_dtype(dtype, config), tp)
    load_weights(model, source, files)
    share = f", rank {tp.rank}'s share of {tp.size}" if tp.size > 1 else ""
    log.info(
        "loaded %s: %d layers, %s%s, %s on %s",
        ckpt,
        config.num_hidden_layers,
        describe_parameters(model),
        share,
        model.model.norm.weight.dtype,
        device,
    )
    return LoadedModel(model.eval(), config, generation_config)


def check_checkpoint(path: str | Path, dtype: torch.dtype | str | None = None) -> Qwen3Config:
    """What load_model would refuse, found from the JSON files and the safetensors headers alone
    (no weight is read): a tensor-parallel engine starts its ranks only for a checkpoint that loads."""
    ckpt, config, _ = read_configs(path)
    resolve_dtype(dtype, config)
    source, files = tensor_files(ckpt)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    for _ in checked_tensors(model, source, files):
        pass
    return config


def read_configs(path: str | Path) -> tuple[Path, Qwen3Config, GenerationConfig]:
    ckpt = Path(path)
    if not ckpt.is_dir():
        raise CheckpointError(f"{ckpt}: checkpoint directory not found")
    config = Qwen3Config.from_file(ckpt / "config.json")
    return ckpt, config, GenerationConfig.from_dir(ckpt, config)


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
        with SafetensorsFile(single) as f:
            return single, dict.fromkeys(f.tensors, single)
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


def split_rows(config: Qwen3Config, tp: TensorParallel) -> dict[str, list[tuple[str, int, range]]]:
    """Our fused column-parallel projections -> the checkpoint projections stacked in them, in
    row order: (name, the tensor's rows, this rank's rows of it)."""
    d = config.head_dim
    heads, kv_heads = tp.split(config.num_attention_heads), tp.kv_heads(config.num_key_value_heads)
    inter = config.intermediate_size
    kv = (config.num_key_value_heads * d, range(kv_heads.start * d, kv_heads.stop * d))
    return {
        "qkv_proj": [
            ("q_proj", config.num_attention_heads * d, range(heads.start * d, heads.stop * d)),
            ("k_proj", *kv),
            ("v_proj", *kv),
        ],
        "gate_up_proj": [("gate_proj", inter, tp.split(inter)), ("up_proj", inter, tp.split(inter))],
    }


def split_columns(config: Qwen3Config, tp: TensorParallel) -> dict[str, tuple[int, range]]:
    """Our row-parallel projections -> (the tensor's columns, this rank's columns of them)."""
    d, heads = config.head_dim, tp.split(config.num_attention_heads)
    return {
        "o_proj": (config.num_attention_heads * d, range(heads.start * d, heads.stop * d)),
        "down_proj": (config.intermediate_size, tp.split(config.intermediate_size)),
    }


def checkpoint_targets(model: Qwen3ForCausalLM) -> dict[str, Target]:
    """Each checkpoint tensor name -> where it goes in the model (worker/model/parallel.py says
    which share of it this rank holds).

    Parameter names are transformers' names except for the fused projections, so the
    checkpoint's layout (and expected shapes) is derived from the model, not written twice.
    """
    config, tp = model.config, model.tp
    fused, row_parallel = split_rows(config, tp), split_columns(config, tp)
    vocab = tp.vocab(config.vocab_size)
    targets = {}
    for name, param in model.named_parameters():
        module, leaf = name.rsplit(".", 1)
        parent, _, proj = module.rpartition(".")
        weight = param.data
        if proj == "experts":
            targets.update(expert_targets(module, leaf, weight, config.moe_intermediate_size, tp))
        elif proj in fused:
            views = weight.split([len(mine) for _, _, mine in fused[proj]])
            for (part, rows, mine), view in zip(fused[proj], views, strict=True):
                targets[f"{parent}.{part}.{leaf}"] = Target(view, (rows, weight.shape[1]), mine)
        elif proj in row_parallel:
            cols, mine = row_parallel[proj]
            targets[name] = Target(weight, (weight.shape[0], cols), range(weight.shape[0]), mine)
        elif proj in ("embed_tokens", "lm_head"):
            targets[name] = Target(weight, (config.vocab_size, weight.shape[1]), vocab)
        else:
            targets[name] = Target(weight, tuple(weight.shape), range(weight.shape[0]))
    return targets


def expert_targets(
    module: str,
    leaf: str,
    stacked: torch.Tensor,
    inter: int,
    tp: TensorParallel,
) -> dict[str, Target]:
    """A MoE layer's stacked expert weight -> the per-expert checkpoint tensors it holds, as
    Hugging Face checkpoints name them: gate_up_proj [E, 2I, H] is each expert's gate_proj rows,
    then its up_proj rows; down_proj [E, H, I] each expert's down_proj. A rank holds its share
    of every expert's intermediate rows (gate, up) and columns (down)."""
    mine = tp.split(inter)
    if leaf == "down_proj":
        hidden = stacked.shape[1]
        return {
            f"{module}.{expert}.down_proj.weight": Target(weight, (hidden, inter), range(hidden), mine)
            for expert, weight in enumerate(stacked)
        }
    hidden = stacked.shape[2]
    return {
        f"{module}.{expert}.{part}.weight": Target(view, (inter, hidden), mine)
        for expert, weight in enumerate(stacked)
        for part, view in zip(("gate_proj", "up_proj"), weight.chunk(2), strict=True)
    }


def load_weights(model: Qwen3ForCausalLM, source: Path, files: dict[str, Path]) -> None:
    for f, name, target in checked_tensors(model, source, files):
        rows = len(target.rows)
        f.read(name, target.dest[:rows], target.rows, target.cols)
        target.dest[rows:].zero_()  # the vocabulary's padding rows on the last rank, when it does not divide


def checked_tensors(
    model: Qwen3ForCausalLM,
    source: Path,
    files: dict[str, Path],
) -> Iterator[tuple[SafetensorsFile, str, Target]]:
    """Each checkpoint tensor the model takes, with its file open, once its presence, shape and
    dtype are checked; file by file."""
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
        with SafetensorsFile(path) as f:
            for name in names:
                shape = list(f.tensors[name].shape)
                expected = list(targets[name].shape)
                if shape != expected:
                    raise CheckpointError(
                        f"{path}: tensor {name} has shape {shape}, expected {expected} from config.json"
                    )
                f.torch_dtype(name)
                yield f, name, targets[name]
