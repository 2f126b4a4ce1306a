"""Checkpoint loading: config validation, fused weights, shards, dtypes, and every error case."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.paged_model import PagedModelRunner
from producer_client.errors import InvalidArgument
from worker.model.config import CheckpointError, Qwen3Config, UnsupportedModel
from worker.model.loader import load_model
from worker.model.presets import qwen3_config, write_random_checkpoint

SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
)


def write_checkpoint(path, dtype=torch.float32, shards=1, **overrides):
    return write_random_checkpoint(path, qwen3_config(**{**SHAPE, **overrides}), seed=11, dtype=dtype, shards=shards)


def edit_json(path, **changes):
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def edit_weights(ckpt, edit):
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@torch.inference_mode()
def prompt_logits(model) -> torch.Tensor:
    runner = PagedModelRunner(model)
    return runner.extend({runner.add_sequence(): [5, 17, 300, 2, 99, 511]})[0]


# --- what loads, and how


def test_config_and_generation_config_are_read(tmp_path):
    ckpt = write_checkpoint(tmp_path, tie_word_embeddings=True)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643], "temperature": 0.6}))
    model, config, generation = load_model(ckpt)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 32)
    assert config.rope_theta == 1e6 and config.tie_word_embeddings
    assert generation.eos_token_ids == [151645, 151643]
    assert generation.temperature == 0.6 and generation.top_k is None


def test_generation_config_falls_back_to_config_json_eos(tmp_path):
    ckpt = write_checkpoint(tmp_path, eos_token_id=151645)
    assert load_model(ckpt).generation_config.eos_token_ids == [151645]


def test_transformers5_config_keys_are_understood(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["rope_theta"], raw["rope_scaling"], raw["torch_dtype"]
    raw.update(rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, dtype="bfloat16")
    (ckpt / "config.json").write_text(json.dumps(raw))
    config = Qwen3Config.from_file(ckpt / "config.json")
    assert config.rope_theta == 5000.0 and config.dtype == torch.bfloat16


def test_fused_projections_stack_checkpoint_rows_in_order(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    layer = load_model(ckpt).model.model.layers[1]
    p = "model.layers.1."
    qkv = torch.cat([tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
    gate_up = torch.cat([tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert torch.equal(layer.mlp.gate_up_proj.weight, gate_up)
    assert torch.equal(layer.self_attn.q_norm.weight, tensors[p + "self_attn.q_norm.weight"])


def test_tied_checkpoint_needs_no_lm_head_and_reads_logits_off_the_embedding(tmp_path):
    ckpt = write_checkpoint(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(ckpt / "model.safetensors")
    model = load_model(ckpt).model
    assert not hasattr(model, "lm_head")
    hidden = torch.randn(3, SHAPE["hidden_size"])
    # Close, not equal: the CPU head kernel sums in its own order (kernels/cpu_linear.py).
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)


def test_sharded_checkpoint_loads_the_same_weights_as_a_single_file(tmp_path):
    single = write_checkpoint(tmp_path / "single")
    sharded = write_checkpoint(tmp_path / "sharded", shards=3)
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == [
        f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)
    ]
    a, b = load_model(single).model.state_dict(), load_model(sharded).model.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    "dtype, expected",
    [
        ("bf16", torch.bfloat16),
        (torch.float16, torch.float16),
        ("float32", torch.float32),
    ],
)
def test_dtype_choice_sets_weights_and_keeps_rope_and_logits_fp32(tmp_path, dtype, expected):
    ckpt = write_checkpoint(tmp_path)
    model = load_model(ckpt, dtype=dtype).model
    assert {p.dtype for p in model.parameters()} == {expected}
    assert model.model.cos_sin.dtype == torch.float32
    logits, exact = prompt_logits(model), prompt_logits(load_model(ckpt, dtype=torch.float32).model)
    assert logits.dtype == torch.float32
    assert ((logits - exact).abs().max() / exact.abs().max()).item() < 3e-2


def test_default_dtype_is_config_torch_dtype(tmp_path):
    bf16 = write_checkpoint(tmp_path / "bf16", dtype=torch.bfloat16)
    fp32 = write_checkpoint(tmp_path / "fp32")
    model = load_model(bf16).model
    assert model.model.norm.weight.dtype == torch.bfloat16
    reference = load_model(fp32, dtype="bf16").model
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_unknown_dtype_is_an_invalid_argument(tmp_path):
    with pytest.raises(InvalidArgument, match="dtype: 'float64' is not one of"):
        load_model(write_checkpoint(tmp_path), dtype="float64")


def test_unused_tensors_are_ignored_with_a_warning(tmp_path, caplog):
    ckpt = write_checkpoint(tmp_path)
    edit_weights(ckpt, lambda t: t.update({"model.rotary_emb.inv_freq": torch.ones(16)}))
    with caplog.at_level(logging.WARNING, logger="worker.model.loader"):
        load_model(ckpt)
    assert "ignoring 1 tensors the model does not use: model.rotary_emb.inv_freq" in caplog.text


# --- errors name the file or tensor


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere: checkpoint directory not found"):
        load_model(tmp_path / "nowhere")


def test_missing_config_json(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: file not found") as e:
        load_model(ckpt)
    assert e.value.code == "checkpoint_error"


def test_missing_weights_file(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(
        CheckpointError, match=r"no weights file \(model\.safetensors or model\.safetensors\.index\.json\)"
    ):
        load_model(ckpt)


def test_missing_shard_named_in_the_index(tmp_path):
    ckpt = write_checkpoint(tmp_path, shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(
        CheckpointError,
        match=r"model-00002-of-00002\.safetensors: shard named in model\.safetensors\.index\.json not found",
    ):
        load_model(ckpt)


def test_missing_tensor(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: missing tensor model\.layers\.1\.mlp\.up_proj\.weight$"
    ):
        load_model(ckpt)


def test_untied_checkpoint_without_lm_head(tmp_path):
    ckpt = write_checkpoint(tmp_path, tie_word_embeddings=False)
    edit_weights(ckpt, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor lm_head\.weight"):
        load_model(ckpt)


def test_missing_tensor_in_sharded_checkpoint_names_the_index(tmp_path):
    ckpt = write_checkpoint(tmp_path, shards=2)
    index = ckpt / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    del weight_map["model.norm.weight"], weight_map["model.embed_tokens.weight"]
    edit_json(index, weight_map=weight_map)
    with pytest.raises(
        CheckpointError, match=r"index\.json: missing tensor model\.embed_tokens\.weight \(and 1 more\)"
    ):
        load_model(ckpt)


def test_shape_mismatch(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 64)}))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor model\.layers\.0\.self_attn\.k_proj\.weight has shape \[32, 64\], "
        r"expected \[64, 64\] from config\.json",
    ):
        load_model(ckpt)


def test_unsupported_model_type(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    edit_json(ckpt / "config.json", model_type="llama")
    message = r"config\.json: model_type 'llama' is not supported \(only 'qwen3' or 'qwen3_moe'\)"
    with pytest.raises(UnsupportedModel, match=message) as e:
        load_model(ckpt)
    assert e.value.code == "unsupported_model"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"rope_scaling": {"rope_type": "linear", "factor": 4.0}}, "rope_scaling.rope_type 'linear'"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type 'dynamic'"),
        (
            {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0}},
            "rope_parameters.rope_type 'llama3'",
        ),
    ],
)
def test_rope_types_other_than_default_and_yarn_are_refused_in_one_line(tmp_path, changes, message):
    ckpt = write_checkpoint(tmp_path)
    edit_json(ckpt / "config.json", **changes)
    with pytest.raises(
        UnsupportedModel, match=rf"config\.json: {message} is not supported \(only 'default' and 'yarn'\)$"
    ):
        load_model(ckpt)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"attention_bias": True}, "attention_bias True"),
        ({"use_sliding_window": True}, "use_sliding_window True"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"quantization_config": {"quant_method": "fp8"}}, r"quantization_config \{'quant_method': 'fp8'\}"),
    ],
)
def test_features_qwen3_does_not_use_are_unsupported(tmp_path, changes, message):
    ckpt = write_checkpoint(tmp_path)
    edit_json(ckpt / "config.json", **changes)
    with pytest.raises(UnsupportedModel, match=rf"config\.json: {message} is not supported"):
        load_model(ckpt)


def test_heads_not_divisible_into_kv_groups(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    edit_json(ckpt / "config.json", num_attention_heads=6, num_key_value_heads=4)
    with pytest.raises(
        CheckpointError, match=r"config\.json: num_attention_heads \(6\) is not a multiple of num_key_value_heads \(4\)"
    ):
        load_model(ckpt)


def test_missing_and_non_positive_config_fields(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["hidden_size"]
    raw["num_hidden_layers"] = 0
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: hidden_size: Field required; num_hidden_layers: Input should be greater than 0",
    ):
        load_model(ckpt)


def test_unreadable_safetensors_file(tmp_path):
    ckpt = write_checkpoint(tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        load_model(ckpt)
