"""Qwen3 checkpoint configuration: config.json and generation_config.json, validated."""
import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    AliasChoices, BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt, ValidationError,
    ValidationInfo, field_validator, model_validator,
)

from producer_client.errors import MiliError
from worker.model.rope import YarnScaling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class CheckpointError(MiliError):
    """A checkpoint directory is incomplete or inconsistent; the message names the file or tensor."""

    code = "checkpoint_error"


class UnsupportedModel(CheckpointError):
    """A well-formed checkpoint of a model or feature this worker does not implement."""

    code = "unsupported_model"


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file not found")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return raw


def describe_validation_error(e: ValidationError) -> str:
    """'field: problem; ...', in words a config.json author can act on."""
    problems = []
    for err in e.errors():
        problem = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
        field = ".".join(map(str, err["loc"]))
        problems.append(f"{field}: {problem}" if field else problem)
    return "; ".join(problems)


def reject_unsupported(raw: dict[str, Any], source: str) -> None:
    """Refuse configs whose numerics we would silently get wrong (biases, windows, RoPE scalings but YaRN)."""
    checks = [
        ("model_type", raw.get("model_type"), "qwen3"),
        ("attention_bias", raw.get("attention_bias", False), False),
        ("use_sliding_window", raw.get("use_sliding_window", False), False),
        ("hidden_act", raw.get("hidden_act", "silu"), "silu"),
    ]
    for field, value, supported in checks:
        if value != supported:
            raise UnsupportedModel(f"{source}: {field} {value!r} is not supported (only {supported!r})")


ROPE_TYPES = ("default", "yarn")


def rope_scaling_of(raw: dict[str, Any], source: str) -> dict[str, Any] | None:
    """config.json's RoPE scaling as YarnScaling's fields, or None for plain RoPE.

    Older configs write `rope_scaling` (with `type` or `rope_type`); transformers 5 writes
    `rope_parameters`, where plain RoPE is rope_type "default". As in transformers, a YaRN
    config without `original_max_position_embeddings` scales from `max_position_embeddings`,
    and one without a `factor` from their ratio.
    """
    key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise CheckpointError(f"{source}: {key} must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModel(f"{source}: {key}.rope_type {rope_type!r} is not supported (only 'default' and 'yarn')")
    if rope_type == "default":
        return None
    yarn = {**params, "rope_type": rope_type}
    yarn.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 32768))
    if yarn.get("factor") is None and "max_position_embeddings" in raw:
        yarn["factor"] = raw["max_position_embeddings"] / yarn["original_max_position_embeddings"]
    return yarn


class Qwen3Config(BaseModel):
    """The config.json fields a Qwen3 decoder needs. Unknown keys are ignored: real files carry many."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    vocab_size: PositiveInt
    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_hidden_layers: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    # Defaults are transformers' Qwen3Config defaults, so a sparse config.json means the same to both.
    head_dim: PositiveInt = 128
    rms_norm_eps: PositiveFloat = 1e-6
    rope_theta: PositiveFloat = 10000.0
    max_position_embeddings: PositiveInt = 32768
    rope_scaling: YarnScaling | None = None  # from rope_scaling or rope_parameters (rope_scaling_of)
    tie_word_embeddings: bool = False
    torch_dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None, validation_alias=AliasChoices("torch_dtype", "dtype")  # transformers 5 writes "dtype"
    )
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    @model_validator(mode="before")
    @classmethod
    def _normalize(cls, raw: Any, info: ValidationInfo) -> Any:
        if not isinstance(raw, dict):
            return raw
        source = (info.context or {}).get("source", "config")
        reject_unsupported(raw, source)
        raw = dict(raw)
        raw.setdefault("num_key_value_heads", raw.get("num_attention_heads"))
        if isinstance(raw.get("rope_parameters"), dict):  # transformers 5 nests rope_theta here
            raw.setdefault("rope_theta", raw["rope_parameters"].get("rope_theta", 10000.0))
        raw["rope_scaling"] = rope_scaling_of(raw, source)
        return raw

    @model_validator(mode="after")
    def _check_shapes(self) -> "Qwen3Config":
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        return self

    @classmethod
    def from_file(cls, path: Path) -> "Qwen3Config":
        try:
            return cls.model_validate(read_json(path), context={"source": str(path)})
        except ValidationError as e:
            raise CheckpointError(f"{path}: {describe_validation_error(e)}") from None

    @property
    def context_length(self) -> int:
        """The positions the model serves: max_position_embeddings, or YaRN's scaled window."""
        return self.rope_scaling.context_length if self.rope_scaling else self.max_position_embeddings

    @property
    def dtype(self) -> torch.dtype:
        """The checkpoint's intended dtype; float32 when the config does not say."""
        return DTYPES[self.torch_dtype or "float32"]


class GenerationConfig(BaseModel):
    """Stop tokens and sampling defaults from generation_config.json; every field is optional."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    eos_token_ids: list[int] = Field(
        default_factory=list, validation_alias=AliasChoices("eos_token_id", "eos_token_ids")
    )
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None

    @field_validator("eos_token_ids", mode="before")
    @classmethod
    def _as_list(cls, value: Any) -> Any:
        if value is None:
            return []
        return [value] if isinstance(value, int) else value

    @classmethod
    def from_dir(cls, ckpt: Path, config: Qwen3Config) -> "GenerationConfig":
        """generation_config.json when present; stop tokens fall back to config.json's, as in transformers."""
        path = ckpt / "generation_config.json"
        raw = read_json(path) if path.is_file() else {}
        raw.setdefault("eos_token_id", config.eos_token_id)
        raw.setdefault("bos_token_id", config.bos_token_id)
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise CheckpointError(f"{path}: {describe_validation_error(e)}") from None
