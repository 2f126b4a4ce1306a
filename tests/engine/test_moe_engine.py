"""The engine on Qwen3-MoE models (conftest's moe_checkpoint, and the tiny-moe preset): batched
greedy generation equal to transformers' Qwen3MoeForCausalLM, the memory plan's profiled step
through the experts, and on CUDA the fused MoE's freedom from host syncs and the KV pool sized
after the expert weights. Decode CUDA graphs of MoE models: tests/engine/test_cuda_graph.py."""

from pathlib import Path
from unittest import mock

import pytest
import torch

import kernels
from producer_client.schema import SamplingParams
from tests.engine.test_engine import random_prompts, token_ids
from worker.engine import Engine, EngineSettings
from worker.engine.kv_pool import KVCacheShape, allocate_kv_caches
from worker.engine.memory import profile_batch
from worker.engine.runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.model.config import parse_config
from worker.model.moe import Qwen3MoeSparseBlock
from worker.model.presets import qwen3_moe_config, random_model

GREEDY = SamplingParams(temperature=0, max_tokens=16)
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def transformers_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations, one prompt at a time (no padding), never stopping early."""
    from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

    model = HFQwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def test_batched_greedy_generation_matches_transformers_one_by_one(moe_checkpoint, moe_loaded, make_moe_engine):
    (model, _, _), _ = moe_loaded
    assert [isinstance(layer.mlp, Qwen3MoeSparseBlock) for layer in model.model.layers] == [True, False, True]
    prompts = random_prompts(10, 1, 60, seed=7)
    # A step budget of 24 tokens chunks the longer prompts' prefill and mixes it with decodes.
    outputs = make_moe_engine(max_num_batched_tokens=24, max_running=6).generate(prompts, GREEDY)
    expected = transformers_greedy(moe_checkpoint, prompts, GREEDY.max_tokens)
    assert token_ids(outputs) == expected
    assert sum(len(set(out)) for out in expected) > 8 * len(prompts)  # continuations that vary


def test_tiny_moe_preset_greedy_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("MILI_CACHE_DIR", str(tmp_path))
    engine = Engine.from_pretrained("tiny-moe", num_pages=128, page_size=16)
    prompts = [engine.tokenizer.encode(text) for text in ("The capital of France is", "def fib(n):", "1, 2, 3,")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    path = next((tmp_path / "presets").glob("tiny-moe-*"))
    assert token_ids(engine.generate(prompts, params)) == transformers_greedy(path, prompts, 12)


def test_the_memory_plans_profiled_step_runs_through_the_experts(moe_loaded):
    (model, config, _), _ = moe_loaded
    settings = EngineSettings(max_num_batched_tokens=40, max_running=6, page_size=4)
    requests, chunks = profile_batch(settings, config.vocab_size)
    shape = KVCacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4, torch.float32)
    runner = ModelRunner(model, allocate_kv_caches(shape, sum(len(r.pages) for r in requests), CPU), 4, CPU)
    with mock.patch.object(kernels, "fused_moe", wraps=kernels.fused_moe) as moe:
        out = Sampler([])(runner.run(chunks), requests)
    assert len(out.token_ids) == 6
    assert [c.args[0].shape[0] for c in moe.call_args_list] == [40, 40]  # both sparse layers, all 40 tokens
    assert moe.call_args_list[0].args[1] is model.model.layers[0].mlp.experts.gate_up_proj


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_the_fused_moe_never_waits_for_the_host():
    # A sync inside a captured graph fails the capture; here any sync raises.
    from kernels.fused_moe import fused_moe_triton

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(64, 256, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(16, 256, 256, device="cuda", generator=g) * 0.05).bfloat16()
    w2 = (torch.randn(16, 256, 128, device="cuda", generator=g) * 0.05).bfloat16()
    weights, ids = torch.softmax(torch.randn(64, 16, device="cuda", generator=g), -1).topk(4)
    fused_moe_triton(hidden, w13, w2, weights.bfloat16(), ids)  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe_triton(hidden, w13, w2, weights.bfloat16(), ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_the_kv_pool_gets_what_the_expert_weights_leave(moe_loaded):
    # Two layers of Qwen3-30B-A3B's experts (2.4 GB in bf16), so leaving them out would show.
    _, tokenizer = moe_loaded
    config = qwen3_moe_config(
        vocab_size=2048,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=2,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
    )
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    model = random_model(config, torch.bfloat16, "cuda")
    experts = sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".experts." in name)
    assert experts == 2 * 128 * 3 * 2048 * 768 * 2
    settings = EngineSettings.parse(gpu_memory_utilization=0.5, max_num_batched_tokens=2048, cuda_graphs=False)
    engine = Engine(model, parse_config(config), tokenizer, settings, [], torch.device("cuda"))
    shape = KVCacheShape(2, 4, 128, settings.page_size, torch.bfloat16)
    assert engine.allocator.num_pages * shape.bytes_per_page <= 0.5 * (free_before - experts)
