"""Qwen3-MoE checkpoints: config.json read as transformers reads it, which layers are sparse,
per-expert tensors stacked in order, a checkpoint saved by transformers itself, and errors."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.paged_model import PagedModelRunner
from worker.model.config import CheckpointError, Qwen3MoeConfig, parse_config
from worker.model.loader import load_model
from worker.model.moe import Qwen3MoeSparseBlock
from worker.model.presets import qwen3_moe_config, write_random_checkpoint

SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=128,
)
PROMPT = [5, 17, 300, 2, 99, 511, 42, 7]


def write_moe_checkpoint(path, **overrides):
    return write_random_checkpoint(path, qwen3_moe_config(**{**SHAPE, **overrides}), seed=11)


@torch.inference_mode()
def prompt_logits(model) -> torch.Tensor:
    runner = PagedModelRunner(model)
    return runner.extend({runner.add_sequence(): PROMPT})[0]


def test_a_sparse_config_means_what_it_means_to_transformers():
    from transformers import Qwen3MoeConfig as HFQwen3MoeConfig

    # Fields left out take transformers' Qwen3MoeConfig defaults, which differ from Qwen3Config's.
    sparse = {
        "model_type": "qwen3_moe",
        "vocab_size": 512,
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
    }
    ours, theirs = parse_config(sparse), HFQwen3MoeConfig(**sparse)
    assert isinstance(ours, Qwen3MoeConfig)
    fields = (
        "intermediate_size",
        "num_key_value_heads",
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "rms_norm_eps",
        "max_position_embeddings",
        "tie_word_embeddings",
    )
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(theirs, f) for f in fields}
    assert ours.head_dim == 128 // 8 and ours.mlp_only_layers == () and ours.rope_theta == 10000.0


@pytest.mark.parametrize("step, mlp_only, experts", [(1, [], 4), (2, [], 4), (1, [0, 3], 4), (3, [2], 4), (1, [], 0)])
def test_sparse_layers_are_the_ones_transformers_builds_as_moe(step, mlp_only, experts):
    from transformers import Qwen3MoeConfig as HFQwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

    config = qwen3_moe_config(
        **{
            **SHAPE,
            "num_hidden_layers": 6,
            "decoder_sparse_step": step,
            "mlp_only_layers": mlp_only,
            "num_experts": experts,
        }
    )
    with torch.device("meta"):
        theirs = HFQwen3MoeForCausalLM(HFQwen3MoeConfig(**config))
    expected = [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in theirs.model.layers]
    ours = parse_config(config)
    assert [ours.is_moe_layer(i) for i in range(6)] == expected
    assert any(expected) == (experts > 0)


def test_each_experts_gate_and_up_rows_stack_in_order_beside_the_dense_layers(tmp_path):
    ckpt = write_moe_checkpoint(tmp_path, mlp_only_layers=[1])
    tensors = load_file(ckpt / "model.safetensors")
    layers = load_model(ckpt).model.model.layers
    assert isinstance(layers[0].mlp, Qwen3MoeSparseBlock) and not isinstance(layers[1].mlp, Qwen3MoeSparseBlock)
    moe, p = layers[0].mlp, "model.layers.0.mlp."
    assert torch.equal(moe.gate.weight, tensors[p + "gate.weight"])
    for e in range(SHAPE["num_experts"]):
        gate_up = torch.cat([tensors[p + f"experts.{e}.gate_proj.weight"], tensors[p + f"experts.{e}.up_proj.weight"]])
        assert torch.equal(moe.experts.gate_up_proj[e], gate_up)
        assert torch.equal(moe.experts.down_proj[e], tensors[p + f"experts.{e}.down_proj.weight"])
    dense = torch.cat([tensors["model.layers.1.mlp.gate_proj.weight"], tensors["model.layers.1.mlp.up_proj.weight"]])
    assert torch.equal(layers[1].mlp.gate_up_proj.weight, dense)


def test_a_checkpoint_transformers_saved_loads_and_gives_its_logits(tmp_path, caplog):
    from transformers import Qwen3MoeConfig as HFQwen3MoeConfig
    from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

    # transformers 5 writes the expert count as num_local_experts, and rope_theta inside rope_parameters.
    config = HFQwen3MoeConfig(**{**SHAPE, "mlp_only_layers": [1], "norm_topk_prob": True, "rope_theta": 5e5})
    torch.manual_seed(0)
    theirs = HFQwen3MoeForCausalLM(config).eval()
    theirs.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["num_local_experts"] == 4 and "num_experts" not in raw
    with caplog.at_level(logging.INFO, logger="worker.model.loader"):
        model, ours, _ = load_model(tmp_path)
    assert (ours.num_experts, ours.num_experts_per_tok, ours.norm_topk_prob, ours.rope_theta) == (4, 2, True, 5e5)
    assert "active per token" in caplog.text
    with torch.inference_mode():
        expected = theirs(torch.tensor([PROMPT])).logits[0]
    got = prompt_logits(model)
    assert ((got - expected).abs().max() / expected.abs().max()).item() <= 1e-4


def test_a_missing_expert_tensor_is_named(tmp_path):
    ckpt = write_moe_checkpoint(tmp_path)
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight$"):
        load_model(ckpt)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) exceeds num_experts \(4\)"),
        ({"mlp_only_layers": [-1]}, r"mlp_only_layers\.0: Input should be greater than or equal to 0"),
        ({"decoder_sparse_step": 0}, r"decoder_sparse_step: Input should be greater than 0"),
    ],
)
def test_inconsistent_expert_settings_are_refused(tmp_path, changes, message):
    ckpt = write_moe_checkpoint(tmp_path)
    raw = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**raw, **changes}))
    with pytest.raises(CheckpointError, match=rf"config\.json: {message}"):
        load_model(ckpt)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16_bit_experts_give_the_float32_logits_within_rounding(tmp_path, dtype):
    ckpt = write_moe_checkpoint(tmp_path, mlp_only_layers=[1])
    model = load_model(ckpt, dtype=dtype).model
    assert {p.dtype for p in model.parameters()} == {dtype}
    logits, exact = prompt_logits(model), prompt_logits(load_model(ckpt, dtype=torch.float32).model)
    assert ((logits - exact).abs().max() / exact.abs().max()).item() < 3e-2
