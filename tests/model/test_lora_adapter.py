"""Reading PEFT adapters (worker/model/lora_adapter.py): peft's scaling rules, and every adapter
the worker cannot serve exactly refused in one line that names the file and the problem; a worker
started with a refused adapter logs that line and keeps serving the rest."""

import json
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from producer_client.errors import UnknownAdapter
from worker.engine.lora.manager import LoraManager
from worker.engine.settings import EngineSettings
from worker.model.config import parse_config
from worker.model.lora import attach_lora
from worker.model.lora_adapter import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    check_adapter,
    read_adapter,
)
from worker.model.presets import PRESETS, qwen3_config
from worker.model.qwen3 import Qwen3ForCausalLM
from worker.model.random_adapter import write_random_adapter

TINY = PRESETS["tiny"].config
MAX_RANK = 16


def meta_model(config: dict) -> Qwen3ForCausalLM:
    with torch.device("meta"):
        return Qwen3ForCausalLM(parse_config(config))


@pytest.fixture(scope="module")
def targets():
    return attach_lora(meta_model(TINY), 2, MAX_RANK)


def refusal(path, targets) -> str:
    with pytest.raises(AdapterError) as e:
        check_adapter(path, targets, MAX_RANK)
    with pytest.raises(AdapterError) as read:
        read_adapter("x", path, targets, MAX_RANK, torch.float32)
    assert read.value.message == e.value.message  # the loader refuses it the same way
    assert e.value.code == "adapter_error" and "\n" not in e.value.message
    return e.value.message


def test_scales_follow_peft_alpha_over_rank_rslora_and_patterns():
    config = AdapterConfig(r=8, lora_alpha=16, alpha_pattern={"o_proj": 4.0, "layers.1.self_attn.q_proj": 2.0})
    assert config.scale("model.layers.0.self_attn.q_proj", 8) == 2.0
    assert config.scale("model.layers.0.self_attn.o_proj", 8) == 0.5
    assert config.scale("model.layers.1.self_attn.q_proj", 4) == 0.5  # rank_pattern's rank, alpha_pattern's alpha
    assert config.scale("model.layers.11.self_attn.q_proj", 8) == 2.0  # a pattern matches after a dot only
    rs = AdapterConfig(r=16, lora_alpha=8, use_rslora=True)
    assert rs.scale("model.layers.0.mlp.down_proj", 16) == 2.0  # alpha / sqrt(r)


def test_an_adapter_reads_with_each_modules_rank_and_scale(targets, tmp_path):
    path = write_random_adapter(
        tmp_path, TINY, 16, ("q_proj", "down_proj"), lora_alpha=8, rank_pattern={"down_proj": 4}
    )
    adapter = read_adapter("x", path, targets, MAX_RANK, torch.float32)
    q, down = adapter.modules["model.layers.2.self_attn.q_proj"], adapter.modules["model.layers.2.mlp.down_proj"]
    assert (q.a.shape, q.b.shape, q.scale) == ((16, 128), (256, 16), 0.5)
    assert (down.a.shape, down.b.shape, down.scale) == ((4, 384), (128, 4), 2.0)
    assert len(adapter.modules) == 8 and check_adapter(path, targets, MAX_RANK) == 16


def test_an_adapter_for_another_base_model_is_refused_naming_the_tensor_and_shapes(targets, tmp_path):
    other = qwen3_config(**{**TINY, "hidden_size": 96})
    path = write_random_adapter(tmp_path, other, 8, ("q_proj",))
    message = refusal(path, targets)
    assert message.startswith(f"{path / WEIGHTS_FILE}: tensor base_model.model.model.layers.0.self_attn.q_proj.lora_A")
    assert "has shape [8, 96], this model needs [8, 128]: an adapter for another base model?" in message


def test_a_rank_over_max_lora_rank_is_refused(targets, tmp_path):
    path = write_random_adapter(tmp_path, TINY, 32, ("v_proj",))
    assert refusal(path, targets).endswith("model.layers.0.self_attn.v_proj has rank 32, over max_lora_rank 16")


@pytest.mark.parametrize(
    "module",
    ["model.embed_tokens", "lm_head", "model.layers.0.mlp.gate", "model.layers.9.self_attn.q_proj"],
)
def test_a_module_the_model_cannot_adapt_is_refused(targets, tmp_path, module):
    path = write_random_adapter(tmp_path, TINY, 8, ("q_proj",))
    tensors = load_file(path / WEIGHTS_FILE)
    tensors[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(8, 128)
    tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(128, 8)
    save_file(tensors, path / WEIGHTS_FILE)
    assert f"targets {module}, which this model cannot adapt" in refusal(path, targets)


def test_a_mixture_of_experts_adapter_on_the_experts_is_refused(tmp_path):
    moe = PRESETS["tiny-moe"].config
    targets = attach_lora(meta_model(moe), 1, MAX_RANK)
    path = write_random_adapter(tmp_path, moe, 8, ("q_proj", "o_proj"))
    assert check_adapter(path, targets, MAX_RANK) == 8  # attention: served
    tensors = load_file(path / WEIGHTS_FILE)
    tensors["base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_A.weight"] = torch.zeros(8, 96)
    tensors["base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight"] = torch.zeros(128, 8)
    save_file(tensors, path / WEIGHTS_FILE)
    assert "targets model.layers.1.mlp.experts.3.down_proj, which this model cannot adapt" in refusal(path, targets)


def test_a_corrupt_or_truncated_file_is_refused(targets, tmp_path):
    path = write_random_adapter(tmp_path, TINY, 8, ("q_proj",))
    whole = (path / WEIGHTS_FILE).read_bytes()
    (path / WEIGHTS_FILE).write_bytes(whole[: len(whole) // 2])
    assert "not a readable safetensors file" in refusal(path, targets)
    (path / WEIGHTS_FILE).write_bytes(b"\x07" * 100)
    assert "not a readable safetensors file" in refusal(path, targets)


@pytest.mark.parametrize(
    "change,problem",
    [
        ({"use_dora": True}, "use_dora: DoRA adapters are not supported"),
        ({"bias": "all"}, "bias terms (bias, lora_bias) are not supported"),
        (
            {"modules_to_save": ["lm_head"]},
            "modules_to_save ['lm_head'] (whole modules, not low-rank) is not supported",
        ),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not LoRA"),
        ({"r": "eight"}, "r: Input should be a valid integer"),
    ],
)
def test_an_adapter_config_the_worker_cannot_serve_exactly_is_refused(targets, tmp_path, change, problem):
    path = write_random_adapter(tmp_path, TINY, 8, ("q_proj",))
    config = json.loads((path / CONFIG_FILE).read_text())
    (path / CONFIG_FILE).write_text(json.dumps({**config, **change}))
    assert refusal(path, targets).startswith(f"{path / CONFIG_FILE}: {problem}")


def test_a_missing_half_or_a_missing_file_is_refused(targets, tmp_path):
    path = write_random_adapter(tmp_path, TINY, 8, ("q_proj",))
    tensors = load_file(path / WEIGHTS_FILE)
    del tensors["base_model.model.model.layers.3.self_attn.q_proj.lora_B.weight"]
    save_file(tensors, path / WEIGHTS_FILE)
    assert refusal(path, targets).endswith("model.layers.3.self_attn.q_proj has no lora_B tensor")
    (path / CONFIG_FILE).unlink()
    assert refusal(path, targets) == f"{path / CONFIG_FILE}: file not found"


def test_a_worker_logs_a_refused_named_adapter_and_serves_the_others(tmp_path, caplog):
    good = write_random_adapter(tmp_path / "good", TINY, 8, ("q_proj",))
    bad = write_random_adapter(tmp_path / "bad", TINY, 64, ("q_proj",))
    settings = EngineSettings.parse(lora_modules={"good": str(good), "bad": str(bad)}, max_lora_rank=MAX_RANK)
    with caplog.at_level(logging.ERROR, logger="worker.engine.lora.manager"):
        manager = LoraManager.attach(meta_model(TINY), settings, torch.device("cpu"))
    assert [r.message for r in caplog.records] == [
        f"LoRA adapter bad refused: {bad / WEIGHTS_FILE}: model.layers.0.self_attn.q_proj has rank 64, over max_lora_rank 16"
    ]
    assert manager.handle("good").name == "good"
    with pytest.raises(AdapterError):
        manager.handle("bad")
    with pytest.raises(UnknownAdapter):
        manager.handle("neither")
