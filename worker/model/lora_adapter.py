"""A LoRA adapter as users have it: PEFT's layout, a directory of adapter_config.json and
adapter_model.safetensors, read and checked against the model it is to serve on.

Tensors are named `base_model.model.<module>.lora_A.weight` ([r, in]) and `.lora_B.weight`
([out, r]), <module> being a projection of the base model (model.layers.0.self_attn.q_proj). A
module's scale is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; rank_pattern and
alpha_pattern give modules a rank and an alpha of their own, matched against the module's name
as peft matches them (the pattern is a suffix of the name after a dot, or the whole name).

What this worker cannot serve exactly is refused with one line naming the file and the problem:
a module the model has no slot for (an expert, the embedding, the LM head), shapes of another base
model, a rank over max_lora_rank, DoRA, bias terms, modules_to_save, a file that is not readable
safetensors, non-finite weights.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, PositiveInt, ValidationError

from worker.model.config import CheckpointError, describe_validation_error, read_json
from worker.model.lora import PROJECTIONS, LoraTarget, SliceWeights
from worker.model.safetensors_file import SafetensorsFile

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
TENSOR_NAME = re.compile(r"(?P<module>.+)\.lora_(?P<part>[AB])\.weight")
TARGET_MODULES = [name for parts in PROJECTIONS.values() for name in parts]


class AdapterError(CheckpointError):
    """A LoRA adapter this worker refuses: the message names the file and the problem."""

    code = "adapter_error"


class AdapterConfig(BaseModel):
    """adapter_config.json's fields that change what the adapter computes (the others are ignored)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    peft_type: str = "LORA"
    r: PositiveInt = 8
    lora_alpha: NonNegativeFloat = 8.0
    use_rslora: bool = False
    use_dora: bool = False
    bias: str = "none"
    lora_bias: bool = False
    modules_to_save: list[str] | None = None
    rank_pattern: dict[str, int] = Field(default_factory=dict)
    alpha_pattern: dict[str, float] = Field(default_factory=dict)

    def refusal(self) -> str | None:
        """What this worker cannot serve exactly, in words; None when it can."""
        if self.peft_type != "LORA":
            return f"peft_type {self.peft_type!r} is not LoRA"
        if self.use_dora:
            return "use_dora: DoRA adapters are not supported"
        if self.bias != "none" or self.lora_bias:
            return "bias terms (bias, lora_bias) are not supported"
        if self.modules_to_save:
            return f"modules_to_save {self.modules_to_save} (whole modules, not low-rank) is not supported"
        return None

    def scale(self, module: str, rank: int) -> float:
        """peft's scaling of `module` at its rank: its alpha over the rank, or the rank's root (rsLoRA)."""
        alpha = self.alpha_pattern[pattern] if (pattern := matching(self.alpha_pattern, module)) else self.lora_alpha
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)


def matching(patterns: dict, module: str) -> str | None:
    """The first pattern that names `module`, as peft's get_pattern_key matches them."""
    return next((p for p in patterns if re.match(rf"(.*\.)?({p})$", module)), None)


@dataclass
class LoraAdapter:
    """An adapter read for this rank: each target module's weights (this rank's share), ready to
    install in a slot."""

    name: str
    path: Path
    modules: dict[str, SliceWeights]

    @property
    def nbytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.modules.values())

    @property
    def max_rank(self) -> int:
        return max(w.a.shape[0] for w in self.modules.values())


def read_config(path: Path) -> AdapterConfig:
    raw = read_json(path / CONFIG_FILE)
    try:
        config = AdapterConfig.model_validate(raw)
    except ValidationError as e:
        raise AdapterError(f"{path / CONFIG_FILE}: {describe_validation_error(e)}") from None
    refusal = config.refusal()
    if refusal:
        raise AdapterError(f"{path / CONFIG_FILE}: {refusal}")
    return config


def read_adapter(
    name: str,
    path: str | Path,
    targets: dict[str, LoraTarget],
    max_rank: int,
    dtype: torch.dtype,
    pin: bool = False,
) -> LoraAdapter:
    """The adapter at `path`, this rank's share of each module in `dtype` (in pinned memory when
    `pin`, for copies to the device that do not wait), once every check passed."""
    path = Path(path)
    with refused_as_adapter():
        config = read_config(path)
        modules = read_modules(path, config, targets, max_rank, dtype, pin)
    return LoraAdapter(name, path, modules)


def read_modules(
    path: Path, config: AdapterConfig, targets: dict[str, LoraTarget], max_rank: int, dtype: torch.dtype, pin: bool
) -> dict[str, SliceWeights]:
    modules = {}
    with SafetensorsFile(path / WEIGHTS_FILE) as f:
        for module, rank, target in checked_modules(f, targets, max_rank):
            a = torch.empty(rank, len(target.a_cols), dtype=dtype, pin_memory=pin)
            b = torch.empty(len(target.b_rows), rank, dtype=dtype, pin_memory=pin)
            f.read(f"{PREFIX}{module}.lora_A.weight", a, range(rank), target.a_cols)
            f.read(f"{PREFIX}{module}.lora_B.weight", b, target.b_rows)
            for part, t in (("A", a), ("B", b)):
                if not torch.isfinite(t).all():
                    raise AdapterError(f"{f.path}: tensor {PREFIX}{module}.lora_{part}.weight has non-finite values")
            modules[module] = SliceWeights(a, b, config.scale(module, rank))
    return modules


def check_adapter(path: str | Path, targets: dict[str, LoraTarget], max_rank: int) -> int:
    """What read_adapter would refuse, from adapter_config.json and the safetensors header alone (no
    weight is read); returns the adapter's largest rank."""
    path = Path(path)
    with refused_as_adapter():
        read_config(path)
        with SafetensorsFile(path / WEIGHTS_FILE) as f:
            return max(rank for _, rank, _ in checked_modules(f, targets, max_rank))


@contextmanager
def refused_as_adapter() -> Iterator[None]:
    """A file missing or unreadable (CheckpointError, from the readers the model's checkpoint
    uses) refuses the adapter, as AdapterError."""
    try:
        yield
    except AdapterError:
        raise
    except CheckpointError as e:
        raise AdapterError(e.message) from None


def checked_modules(
    f: SafetensorsFile, targets: dict[str, LoraTarget], max_rank: int
) -> Iterator[tuple[str, int, LoraTarget]]:
    """Each module the file adapts, its rank and where it goes, once its two tensors are checked."""
    pairs = tensor_pairs(f)
    if not pairs:
        raise AdapterError(f"{f.path}: holds no LoRA tensors ({PREFIX}<module>.lora_A.weight)")
    for module in sorted(pairs):
        target = targets.get(module)
        if target is None:
            raise AdapterError(
                f"{f.path}: targets {module}, which this model cannot adapt (LoRA is served on "
                f"{', '.join(TARGET_MODULES)} of the decoder layers, not on experts, embeddings or the LM head)"
            )
        if set(pairs[module]) != {"A", "B"}:
            missing = ({"A", "B"} - set(pairs[module])).pop()
            raise AdapterError(f"{f.path}: {module} has no lora_{missing} tensor")
        a, b = (f.tensors[f"{PREFIX}{module}.lora_{part}.weight"] for part in "AB")
        rank = a.shape[0] if len(a.shape) == 2 else 0
        expected = {"A": [rank, target.in_features], "B": [target.out_features, rank]}
        for part, entry in (("A", a), ("B", b)):
            if list(entry.shape) != expected[part] or rank == 0:
                raise AdapterError(
                    f"{f.path}: tensor {PREFIX}{module}.lora_{part}.weight has shape {list(entry.shape)}, this "
                    f"model needs {expected[part]}: an adapter for another base model?"
                )
            f.torch_dtype(f"{PREFIX}{module}.lora_{part}.weight")
        if rank > max_rank:
            raise AdapterError(f"{f.path}: {module} has rank {rank}, over max_lora_rank {max_rank}")
        yield module, rank, target


def tensor_pairs(f: SafetensorsFile) -> dict[str, list[str]]:
    """{module: the parts (A, B) the file has of it}; AdapterError for a tensor of any other kind."""
    pairs: dict[str, list[str]] = {}
    for name in f.tensors:
        m = TENSOR_NAME.fullmatch(name.removeprefix(PREFIX)) if name.startswith(PREFIX) else None
        if m is None:
            raise AdapterError(f"{f.path}: tensor {name} is not a LoRA weight this worker serves")
        pairs.setdefault(m["module"], []).append(m["part"])
    return pairs
