"""An EAGLE-3 head's config, read from either layout the published heads ship in.

- EAGLE's own and SpecForge's (the Qwen3 heads of AngelSlim and others): a Llama config.json
  (`architectures` LlamaForCausalLMEagle3) with `draft_vocab_size`, an optional `target_hidden_size`
  and an optional `eagle_config.eagle_aux_hidden_state_layer_ids`, the target layers whose outputs
  the head reads (SGLang's convention: id i is layer i's output). Weights `midlayer.*`.
- The `speculators` format (RedHatAI's heads): `speculators_model_type` eagle3, the layer's Llama
  config under `transformer_layer_config`, and at the top `draft_vocab_size`, `target_hidden_size`,
  `norm_before_residual` (default true there) and `eagle_aux_hidden_state_layer_ids` in vLLM's
  convention, where id j is the input of layer j (layer j-1's output). Weights `layers.0.*`.

Either way the result is the target's layer inputs to capture (`aux_layer_inputs`); without ids,
the inputs of layers 2, L/2 and L-3, the default both vLLM and SGLang use.

This follows the layouts as vLLM's and SGLang's loaders read them; no downloaded head has been
loaded here (there is no hub access), only random heads written in these layouts
(eagle3_checkpoint.write_random_eagle3_head).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, PositiveFloat, PositiveInt, ValidationError

from worker.model.config import CheckpointError, describe_validation_error, read_json

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")


class Eagle3Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: PositiveInt
    intermediate_size: PositiveInt
    num_attention_heads: PositiveInt
    num_key_value_heads: PositiveInt
    head_dim: PositiveInt
    rms_norm_eps: PositiveFloat
    rope_theta: PositiveFloat
    max_position_embeddings: PositiveInt
    vocab_size: PositiveInt
    draft_vocab_size: PositiveInt
    target_hidden_size: PositiveInt
    norm_before_residual: bool  # the hidden state's norm feeds the residual too (speculators' variant)
    aux_layer_ids: tuple[int, ...] | None  # as the file gives them, in its own convention
    ids_name_layer_inputs: bool  # vLLM's convention (speculators) rather than SGLang's (layer outputs)

    def aux_layer_inputs(self, num_target_layers: int) -> tuple[int, int, int]:
        """The target layers whose input (layer L: the last layer's output) the head reads, in order."""
        if self.aux_layer_ids is None:
            inputs = (2, num_target_layers // 2, num_target_layers - 3)
        else:
            inputs = tuple(i if self.ids_name_layer_inputs else i + 1 for i in self.aux_layer_ids)
        if len(inputs) != 3 or not all(0 <= i <= num_target_layers for i in inputs):
            raise CheckpointError(
                f"the EAGLE-3 head reads target layers {inputs}: it needs three of the model's "
                f"{num_target_layers} layers' inputs (0 to {num_target_layers})"
            )
        return inputs  # type: ignore[return-value]


def read_eagle3_config(path: Path) -> Eagle3Config:
    raw = read_json(path / "config.json")
    speculators = raw.get("speculators_model_type") is not None
    if speculators and raw["speculators_model_type"] != "eagle3":
        raise CheckpointError(f"{path}: speculators_model_type {raw['speculators_model_type']!r} is not eagle3")
    if not speculators and not set(raw.get("architectures") or ()) & set(ARCHITECTURES):
        raise CheckpointError(f"{path}: not an EAGLE-3 head (architectures {raw.get('architectures')})")
    layer = raw.get("transformer_layer_config", {}) if speculators else raw
    try:
        return Eagle3Config(**fields_of(raw, layer, speculators))
    except ValidationError as e:
        raise CheckpointError(f"{path / 'config.json'}: {describe_validation_error(e)}") from None


def fields_of(raw: dict[str, Any], layer: dict[str, Any], speculators: bool) -> dict[str, Any]:
    if layer.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(
            f"an EAGLE-3 head of {layer['num_hidden_layers']} layers: only one-layer heads are served"
        )
    if layer.get("rope_scaling") or raw.get("norm_before_fc"):
        raise CheckpointError("an EAGLE-3 head with rope_scaling or norm_before_fc is not supported")
    heads = layer.get("num_attention_heads")
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state") is False:
        raise CheckpointError("an EAGLE-3 head without the target's auxiliary hidden states is not supported")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") if speculators else eagle.get("eagle_aux_hidden_state_layer_ids")
    return {
        "hidden_size": layer.get("hidden_size"),
        "intermediate_size": layer.get("intermediate_size"),
        "num_attention_heads": heads,
        "num_key_value_heads": layer.get("num_key_value_heads", heads),
        "head_dim": layer.get("head_dim") or (layer.get("hidden_size", 0) // (heads or 1)),
        "rms_norm_eps": layer.get("rms_norm_eps", 1e-6),
        "rope_theta": layer.get("rope_theta", 10000.0),
        "max_position_embeddings": layer.get("max_position_embeddings", 8192),
        "vocab_size": layer.get("vocab_size"),
        "draft_vocab_size": raw.get("draft_vocab_size") or layer.get("vocab_size"),
        "target_hidden_size": raw.get("target_hidden_size") or layer.get("hidden_size"),
        "norm_before_residual": bool(raw.get("norm_before_residual", speculators)),
        "aux_layer_ids": tuple(ids) if ids else None,
        "ids_name_layer_inputs": speculators,
    }
