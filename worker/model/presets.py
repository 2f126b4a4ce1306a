"""Model presets: seeded random-weight Qwen3 checkpoints in Hugging Face layout, written on first use.

The presets are Python data rather than a file under config/ because they are part of the code's
contract (tests and benchmarks rely on their shapes) and must ship inside the installed package.

tiny, tiny-moe and small are stored in float32, the dtype they run in on CPU (the demo, the tests
and the CPU benchmarks); qwen3-0.6b is stored in bfloat16 like the real checkpoint, halving its 2.4 GB.
Each preset directory is named after a fingerprint of its spec, so changing a spec writes a new
directory instead of silently reusing stale weights.
"""

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from worker.model.cache import cache_dir
from worker.model.config import DTYPES, CheckpointError, Qwen3Config, parse_config
from worker.model.loader import INDEX_FILE, SINGLE_FILE, checkpoint_targets
from worker.model.names import PRESET_NAMES, no_such_checkpoint
from worker.model.progress import logged_step
from worker.model.qwen3 import Qwen3ForCausalLM
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files

log = logging.getLogger(__name__)

# Bump when the files written for a preset change in a way its spec does not show.
LAYOUT_VERSION = 1

# Qwen3-0.6B's generation_config.json, verbatim.
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}


def qwen3_config(**shape: Any) -> dict[str, Any]:
    """A config.json for a Qwen3 of the given shape; the rest as in Qwen3-0.6B's config.json."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 28,
        "use_cache": True,
        **shape,
    }


def qwen3_moe_config(**shape: Any) -> dict[str, Any]:
    """A config.json for a Qwen3-MoE of the given shape; the rest as in Qwen3-30B-A3B's config.json."""
    return qwen3_config(
        **{
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "max_window_layers": 48,
            **shape,
        }
    )


@dataclass(frozen=True)
class Preset:
    config: dict[str, Any]
    dtype: torch.dtype
    seed: int = 0

    def fingerprint(self) -> str:
        spec = json.dumps([self.config, str(self.dtype), self.seed, LAYOUT_VERSION], sort_keys=True)
        return hashlib.sha256(spec.encode()).hexdigest()[:10]


# In the order of their names, PRESET_NAMES (worker.model.names: what a worker checks without torch).
PRESET_SPECS = (
    # tiny: 20.4M parameters, 19.4M of them the embedding: fast enough for every CPU test.
    Preset(
        qwen3_config(
            hidden_size=128,
            intermediate_size=384,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=True,
        ),
        torch.float32,
    ),
    # tiny-moe: tiny's attention with 8 experts (2 per token) in every layer's MLP: 21.0M parameters.
    Preset(
        qwen3_moe_config(
            hidden_size=128,
            intermediate_size=384,
            moe_intermediate_size=96,
            num_experts=8,
            num_experts_per_tok=2,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            tie_word_embeddings=True,
        ),
        torch.float32,
    ),
    # small: ~103M parameters for CPU benchmarks.
    Preset(
        qwen3_config(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            tie_word_embeddings=True,
        ),
        torch.float32,
    ),
    # qwen3-0.6b: the real Qwen3-0.6B shape (596M parameters) for GPU benchmarks.
    Preset(
        qwen3_config(
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
        torch.bfloat16,
    ),
)
PRESETS = dict(zip(PRESET_NAMES, PRESET_SPECS, strict=True))


def resolve_model_path(name_or_path: str | Path) -> Path:
    """A preset name -> its checkpoint directory (written on first use); anything else is a directory."""
    preset = PRESETS.get(str(name_or_path))
    if preset is not None:
        return ensure_preset(str(name_or_path), preset)
    return checkpoint_directory(name_or_path)


def model_config(name_or_path: str | Path) -> Qwen3Config:
    """The config of a preset (written or not) or of a checkpoint directory, read before any weight is."""
    preset = PRESETS.get(str(name_or_path))
    if preset is not None:
        return parse_config(preset.config, str(name_or_path))
    return Qwen3Config.from_file(checkpoint_directory(name_or_path) / "config.json")


def checkpoint_directory(name_or_path: str | Path) -> Path:
    """The directory a name that is no preset names; CheckpointError if it is none."""
    path = Path(name_or_path).expanduser()
    if not path.is_dir():
        raise CheckpointError(no_such_checkpoint(name_or_path))
    return path


def ensure_preset(name: str, preset: Preset) -> Path:
    root = cache_dir() / "presets"
    target = root / f"{name}-{preset.fingerprint()}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    # The lock only saves duplicate work between processes; the rename is what makes it safe.
    with exclusive_lock(root / f".{target.name}.lock"):
        if not target.is_dir():
            remove_abandoned_writes(target)
            write_preset(name, preset, target)
    return target


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def remove_abandoned_writes(target: Path) -> None:
    """Temp dirs of writers that died mid-write; only the lock holder writes, so none is live."""
    for stale in target.parent.glob(f".{target.name}.*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def write_preset(name: str, preset: Preset, target: Path) -> None:
    with logged_step(log, f"writing preset {name!r} to {target} (its first use: random weights, the tokenizer)"):
        write_preset_files(preset, target)


def write_preset_files(preset: Preset, target: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write_random_checkpoint(tmp, preset.config, seed=preset.seed, dtype=preset.dtype)
        write_json(tmp / "generation_config.json", QWEN3_GENERATION_CONFIG)
        write_qwen3_tokenizer_files(tmp)
        tmp.chmod(0o755)
        os.rename(tmp, target)  # atomic: readers see no directory or a complete one
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_random_checkpoint(
    out_dir: str | Path,
    config: dict[str, Any],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    shards: int = 1,
    norm_std: float = 0.0,
) -> Path:
    """Write config.json and seeded random weights in transformers' layout and tensor names.

    Matrices are N(0, initializer_range) as in transformers' init; RMSNorm scales are
    1 + N(0, norm_std) (tests perturb them so a dropped norm weight cannot go unnoticed).
    The draws do not depend on `dtype` or `shards`, so those variants hold the same weights.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": next(name for name, d in DTYPES.items() if d == dtype)}
    shapes = checkpoint_shapes(parse_config(config))
    generator = torch.Generator().manual_seed(seed)
    std = config.get("initializer_range", 0.02)
    names = list(shapes)
    groups = [names[i * len(names) // shards : (i + 1) * len(names) // shards] for i in range(shards)]
    weight_map, total_size = {}, 0
    for i, group in enumerate(groups):
        file = SINGLE_FILE if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {}
        for name in group:
            scale, offset = (norm_std, 1.0) if len(shapes[name]) == 1 else (std, 0.0)
            tensors[name] = (offset + scale * torch.randn(shapes[name], generator=generator)).to(dtype)
            total_size += tensors[name].nbytes
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    if shards > 1:
        write_json(out_dir / INDEX_FILE, {"metadata": {"total_size": total_size}, "weight_map": weight_map})
    write_json(out_dir / "config.json", config)
    return out_dir


def checkpoint_shapes(config: Qwen3Config) -> dict[str, torch.Size]:
    """Checkpoint tensor names and shapes, read off a model built on the meta device (no memory)."""
    with torch.device("meta"):
        return {name: torch.Size(t.shape) for name, t in checkpoint_targets(Qwen3ForCausalLM(config)).items()}


def random_model(
    config: dict[str, Any],
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
) -> Qwen3ForCausalLM:
    """A model of `config`'s shape with random weights drawn on `device`, no checkpoint written:
    for benchmarks of shapes too large to write out (Qwen3-30B-A3B's weights are 61 GB). The
    weights are drawn as write_random_checkpoint's (matrices N(0, initializer_range), unit norm
    scales), though not the same values."""
    with torch.device(device):
        model = Qwen3ForCausalLM(parse_config(config), dtype)
    generator = torch.Generator(device).manual_seed(seed)
    std = config.get("initializer_range", 0.02)
    for param in model.parameters():
        if param.dim() == 1:
            param.fill_(1.0)
        else:
            param.normal_(0.0, std, generator=generator)
    return model.eval()
