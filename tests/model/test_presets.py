"""Presets: written once into the cache directory, atomically, then reused; loadable; real tokenizer."""

import threading

import pytest
import torch

from harness.paged_model import PagedModelRunner
from worker.model import presets
from worker.model.config import CheckpointError, Qwen3MoeConfig, parse_config
from worker.model.loader import load_model
from worker.model.presets import PRESETS, checkpoint_shapes, random_model, resolve_model_path
from worker.model.qwen3 import Qwen3ForCausalLM
from worker.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("mili_cache")
        mp.setenv("MILI_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def tiny(cache_dir):
    """The tiny preset, first resolved by three threads at once; returns (its path, write count)."""
    writes = []
    write_preset = presets.write_preset

    def counting_write(*args):
        writes.append(args)
        write_preset(*args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(presets, "write_preset", counting_write)
        paths = []
        threads = [threading.Thread(target=lambda: paths.append(resolve_model_path("tiny"))) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(paths) == 3 and len(set(paths)) == 1
    return paths[0], len(writes)


def test_concurrent_first_use_writes_tiny_once_and_leaves_no_temp_dirs(cache_dir, tiny):
    path, writes = tiny
    assert writes == 1
    assert path.parent == cache_dir / "presets" and path.name.startswith("tiny-")
    assert [p.name for p in path.parent.iterdir() if p.is_dir()] == [path.name]
    assert {p.name for p in path.iterdir()} == {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_second_resolve_reuses_the_written_directory(tiny, monkeypatch):
    path, _ = tiny
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(presets, "write_preset", lambda *a: pytest.fail("preset written twice"))
    assert resolve_model_path("tiny") == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime


def test_tiny_loads_with_the_qwen3_tokenizer_and_generation_config(tiny):
    path, _ = tiny
    model, config, generation = load_model(path)
    assert (config.vocab_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        151936,
        4,
        2,
        64,
    )
    assert config.tie_word_embeddings and model.model.norm.weight.dtype == torch.float32
    assert generation.eos_token_ids == [151645, 151643]
    tokenizer = Tokenizer.from_dir(path)
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 151644
    assert {151643, 151645} <= tokenizer.eos_token_ids


def test_tiny_logits_are_non_degenerate_and_match_transformers(tiny):
    from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

    path, _ = tiny
    prompt = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 279, 6722, 30]
    runner = PagedModelRunner(load_model(path).model)
    logits = runner.extend({runner.add_sequence(): prompt})[0]
    with torch.inference_mode():
        expected = HFQwen3ForCausalLM.from_pretrained(path, torch_dtype=torch.float32)(torch.tensor([prompt])).logits[0]
    assert ((logits - expected).abs().max() / expected.abs().max()).item() <= 1e-4
    # HF-scale init (std 0.02) with unit norms: logits spread, and each position prefers something else.
    assert 0.05 < logits.std(-1).min().item() and logits.std(-1).max().item() < 2.0
    assert len(set(logits.argmax(-1).tolist())) > len(prompt) // 2


def test_tiny_moe_is_tiny_with_a_mixture_of_experts_and_matches_transformers(cache_dir):
    from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

    path = resolve_model_path("tiny-moe")
    model, config, generation = load_model(path)
    assert isinstance(config, Qwen3MoeConfig) and generation.eos_token_ids == [151645, 151643]
    assert (config.num_experts, config.num_experts_per_tok, config.moe_intermediate_size, config.norm_topk_prob) == (
        8,
        2,
        96,
        True,
    )
    assert all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    assert Tokenizer.from_dir(path).encode("<|im_start|>")[0] == 151644
    prompt = [9707, 11, 1879, 0, 151644, 872, 198, 3838, 374, 279, 6722, 30]
    runner = PagedModelRunner(model)
    logits = runner.extend({runner.add_sequence(): prompt})[0]
    with torch.inference_mode():
        expected = HFQwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([prompt])).logits[0]
    assert ((logits - expected).abs().max() / expected.abs().max()).item() <= 1e-4
    assert len(set(logits.argmax(-1).tolist())) > len(prompt) // 2


def test_tiny_moe_decode_steps_give_transformers_logits(cache_dir):
    from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

    # At transformers' init scale greedy decoding repeats one token, so the steps' logits are
    # compared too: each against transformers' forward over the whole sequence so far.
    path = resolve_model_path("tiny-moe")
    runner = PagedModelRunner(load_model(path).model)
    seq = runner.add_sequence()
    tokens = [9707, 11, 1879, 0, 151644, 872, 198]
    steps = [runner.extend({seq: tokens})[0][-1]]
    for _ in range(6):
        tokens.append(steps[-1].argmax().item())
        steps.append(runner.decode({seq: tokens[-1]})[0])
    with torch.inference_mode():
        expected = HFQwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32)(torch.tensor([tokens])).logits[0]
    got, want = torch.stack(steps), expected[-len(steps) :]
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_random_model_has_the_presets_shapes_with_drawn_weights():
    config = PRESETS["tiny-moe"].config
    model = random_model(config, torch.float32, "cpu")
    shapes = {name: p.shape for name, p in model.named_parameters()}
    with torch.device("meta"):
        assert shapes == {name: p.shape for name, p in Qwen3ForCausalLM(parse_config(config)).named_parameters()}
    experts = model.model.layers[0].mlp.experts.gate_up_proj
    assert abs(experts.std().item() - config["initializer_range"]) < 1e-3
    assert torch.equal(model.model.norm.weight, torch.ones(128))


def test_abandoned_temp_dirs_are_removed_when_the_preset_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("MILI_CACHE_DIR", str(tmp_path))
    micro = presets.Preset(
        presets.qwen3_config(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=True,
        ),
        torch.float32,
    )
    monkeypatch.setitem(PRESETS, "micro", micro)
    monkeypatch.setattr(presets, "write_qwen3_tokenizer_files", lambda out_dir: None)
    abandoned = tmp_path / "presets" / f".micro-{micro.fingerprint()}.dead1234"
    abandoned.mkdir(parents=True)
    (abandoned / "config.json").write_text("{")
    path = resolve_model_path("micro")
    assert not abandoned.exists()
    assert load_model(path).config.num_hidden_layers == 1


def test_a_directory_resolves_to_itself_and_anything_else_is_an_error(tmp_path):
    assert resolve_model_path(str(tmp_path)) == tmp_path
    message = r"tiyn: no such checkpoint directory, nor a preset \(tiny, tiny-moe, small, qwen3-0.6b\)"
    with pytest.raises(CheckpointError, match=message):
        resolve_model_path("tiyn")


def test_preset_sizes():
    def params(name, experts_only=False):
        shapes = checkpoint_shapes(parse_config(PRESETS[name].config))
        return sum(shape.numel() for name, shape in shapes.items() if not experts_only or ".experts." in name)

    assert params("tiny") == 20_432_512
    # tiny's attention; 8 experts of 3 x 128 x 96 and a router of 8 x 128 in place of each 128 -> 384 MLP.
    assert params("tiny-moe") == params("tiny") + 4 * (8 * 3 * 128 * 96 + 8 * 128 - 3 * 128 * 384) == 21_026_432
    assert params("tiny-moe", experts_only=True) == 4 * 8 * 3 * 128 * 96
    assert 95e6 < params("small") < 110e6
    # Qwen3-0.6B's published count: 0.6B in all, 0.44B without the (tied) embedding.
    assert params("qwen3-0.6b") == 596_049_920
    assert params("qwen3-0.6b") - 151936 * 1024 == 440_467_456
    config = PRESETS["qwen3-0.6b"].config
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (1024, 28, 3072)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (16, 8, 128)
    assert (config["rope_theta"], config["max_position_embeddings"], config["tie_word_embeddings"]) == (
        1e6,
        40960,
        True,
    )
    assert PRESETS["qwen3-0.6b"].dtype == torch.bfloat16
