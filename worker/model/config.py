"""Qwen3 checkpoint configuration: config.json and generation_config.json, validated.

config.json's model_type picks the class: `qwen3` (dense) or `qwen3_moe` (Qwen3-30B-A3B and
its family, whose MLPs are mixtures of experts in the layers the config names).
"""

import json
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# Named here too, where the model's modules have always imported them from.
from worker.model.errors import CheckpointError as CheckpointError
from worker.model.errors import UnsupportedModel as UnsupportedModel
from worker.model.rope import YarnScaling

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        None,
        validation_alias=AliasChoices("torch_dtype", "dtype"),  # transformers 5 writes "dtype"
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
        """The config of path's model_type (a Qwen3MoeConfig for `qwen3_moe`), validated."""
        try:
            return parse_config(read_json(path), str(path))
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

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` (from 0) has a mixture-of-experts MLP; a dense Qwen3 has none."""
        return False


class Qwen3MoeConfig(Qwen3Config):
    """config.json of a Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention; in each sparse layer a
    router sends every token to `num_experts_per_tok` of `num_experts` SwiGLU experts.

    Defaults are transformers' Qwen3MoeConfig defaults (not Qwen3Config's: head_dim follows the
    hidden size, and 4 kv heads), so a sparse config.json means the same to both.
    """

    intermediate_size: PositiveInt = 6144  # the dense layers' MLP (mlp_only_layers, decoder_sparse_step)
    num_key_value_heads: PositiveInt = 4
    # transformers 5 writes the count as num_local_experts; Hugging Face checkpoints as num_experts.
    num_experts: NonNegativeInt = Field(128, validation_alias=AliasChoices("num_experts", "num_local_experts"))
    num_experts_per_tok: PositiveInt = 8
    moe_intermediate_size: PositiveInt = 768
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: PositiveInt = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: tuple[NonNegativeInt, ...] = ()  # ... and i is not listed here

    @model_validator(mode="before")
    @classmethod
    def _moe_defaults(cls, raw: Any) -> Any:
        # Runs before Qwen3Config's own defaults, which would fill these differently.
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        raw.setdefault("num_key_value_heads", 4)
        hidden, heads = raw.get("hidden_size"), raw.get("num_attention_heads")
        if "head_dim" not in raw and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            raw["head_dim"] = hidden // heads
        if raw.get("mlp_only_layers") is None:
            raw["mlp_only_layers"] = ()
        return raw

    @model_validator(mode="after")
    def _check_experts(self) -> "Qwen3MoeConfig":
        if self.num_experts and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
            )
        return self

    def is_moe_layer(self, layer: int) -> bool:
        # transformers' rule (Qwen3MoeDecoderLayer): listed layers stay dense, as do all without experts.
        return (
            self.num_experts > 0 and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        )


CONFIG_CLASSES: dict[str, type[Qwen3Config]] = {"qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}


def parse_config(raw: dict[str, Any], source: str = "config") -> Qwen3Config:
    """raw's model_type picks the class; UnsupportedModel for a model_type outside CONFIG_CLASSES.
    Raises pydantic's ValidationError for a bad field (from_file words it for the user)."""
    model_type = raw.get("model_type")
    if model_type not in CONFIG_CLASSES:
        supported = " or ".join(map(repr, CONFIG_CLASSES))
        raise UnsupportedModel(f"{source}: model_type {model_type!r} is not supported (only {supported})")
    # Quantized weights (FP8, AWQ, GPTQ) would be copied into 16-bit parameters without their scales.
    quantization = raw.get("quantization_config")
    if quantization is not None:
        raise UnsupportedModel(f"{source}: quantization_config {quantization!r} is not supported (only None)")
    return CONFIG_CLASSES[model_type].model_validate(raw, context={"source": source})


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
