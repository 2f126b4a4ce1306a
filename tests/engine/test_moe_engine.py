"""The engine on Qwen3-MoE models: batched greedy generation equal to transformers'
Qwen3MoeForCausalLM, the decode CUDA graphs' padded batches (run eagerly on CPU, captured on
CUDA), and the memory plan's profiled step. The checkpoint mixes a dense layer between sparse
ones and routes each token to 3 of 6 experts, not renormalized; the tiny-moe preset routes to 2
of 8, renormalized."""
from unittest import mock

import pytest
import torch
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

import kernels
from producer_client.schema import SamplingParams
from tests.engine.test_engine import random_prompts, token_ids
from worker.engine import Engine, EngineSettings
from worker.engine.cuda_graph import DecodeGraphRunner
from worker.engine.kv_pool import KVCacheShape, allocate_kv_caches, pages_for
from worker.engine.memory import profile_batch
from worker.engine.runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.model.loader import load_model
from worker.model.moe import Qwen3MoeSparseBlock
from worker.model.config import parse_config
from worker.model.presets import qwen3_moe_config, random_model, write_random_checkpoint
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files
from worker.model.tokenizer import Tokenizer

VOCAB = 2048
GREEDY = SamplingParams(temperature=0, max_tokens=16)
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # Weights at 0.3, as tests/engine/conftest.py's, so greedy continuations vary.
    config = qwen3_moe_config(
        vocab_size=VOCAB, max_position_embeddings=512, hidden_size=64, intermediate_size=128,
        moe_intermediate_size=32, num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1],
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
        initializer_range=0.3, bos_token_id=None, eos_token_id=None,
    )
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("moe_engine_ckpt"), config, seed=5, norm_std=0.1)
    write_qwen3_tokenizer_files(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def loaded(checkpoint):
    return load_model(checkpoint, dtype=torch.float32), Tokenizer.from_dir(checkpoint)


@pytest.fixture(scope="module")
def make_engine(loaded):
    (model, config, _), tokenizer = loaded

    def make(**settings) -> Engine:
        settings = {"num_pages": 256, "page_size": 4, **settings}
        return Engine(model, config, tokenizer, EngineSettings.parse(**settings), [], CPU)

    return make


def hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = HFQwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outs.append(out[0, len(prompt):].tolist())
    return outs


def test_batched_greedy_generation_matches_transformers_one_by_one(checkpoint, loaded, make_engine):
    (model, _, _), _ = loaded
    assert [isinstance(layer.mlp, Qwen3MoeSparseBlock) for layer in model.model.layers] == [True, False, True]
    prompts = random_prompts(10, 1, 60, seed=7)
    # A step budget of 24 tokens chunks the longer prompts' prefill and mixes it with decodes.
    outputs = make_engine(max_num_batched_tokens=24, max_running=6).generate(prompts, GREEDY)
    expected = hf_greedy(checkpoint, prompts, GREEDY.max_tokens)
    assert token_ids(outputs) == expected
    assert sum(len(set(out)) for out in expected) > 8 * len(prompts)  # continuations that vary


def test_tiny_moe_preset_greedy_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("MILI_CACHE_DIR", str(tmp_path))
    engine = Engine.from_pretrained("tiny-moe", num_pages=128, page_size=16)
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(text) for text in ("The capital of France is", "def fib(n):", "1, 2, 3,")]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    path = next((tmp_path / "presets").glob("tiny-moe-*"))
    assert token_ids(engine.generate(prompts, params)) == hf_greedy(path, prompts, 12)


def start_decoding(engine: Engine, prompts: list[list[int]]):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    chunks = engine.scheduler.schedule().chunks
    assert [c.num_tokens for c in chunks] == [1] * len(prompts)
    return engine.runner.prepare(chunks)


@pytest.mark.parametrize("batch", [3, 6])
def test_a_padded_decode_step_matches_the_unpadded_one(make_engine, batch):
    # Padding rows are routed to experts too, sharing blocks with real rows: they must not change them.
    engine = make_engine()
    inputs = start_decoding(engine, random_prompts(batch, 3, 30, seed=batch))
    model, caches = engine.runner.model, engine.runner.kv_caches
    padded_caches = [(k.clone(), v.clone()) for k, v in caches]
    graphs = DecodeGraphRunner(model, padded_caches, 8, pages_for(engine.max_model_len, 4), CPU)
    padded = graphs.run(inputs)
    with torch.inference_mode():
        eager = model.compute_logits(model(inputs.input_ids, inputs.positions, inputs.meta, caches))
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))


def test_an_engine_replaying_padded_decodes_generates_what_the_eager_engine_does(make_engine):
    prompts = random_prompts(7, 1, 40, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i) for i in range(7)]  # batches shrink 7 -> 1
    expected = token_ids(make_engine().generate(prompts, params))
    engine = make_engine(max_running=7)
    graphs = DecodeGraphRunner(engine.runner.model, engine.runner.kv_caches, 7, pages_for(engine.max_model_len, 4), CPU)
    engine.runner.decode_graphs = graphs
    with mock.patch.object(graphs, "run", wraps=graphs.run) as replays:
        assert token_ids(engine.generate(prompts, params)) == expected
    assert {call.args[0].input_ids.shape[0] for call in replays.call_args_list} == set(range(1, 8))


def test_the_memory_plans_profiled_step_runs_through_the_experts(loaded):
    (model, config, _), _ = loaded
    settings = EngineSettings(max_num_batched_tokens=40, max_running=6, page_size=4)
    requests, chunks = profile_batch(settings, config.vocab_size)
    shape = KVCacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4, torch.float32)
    runner = ModelRunner(model, allocate_kv_caches(shape, sum(len(r.pages) for r in requests), CPU), 4, CPU)
    experts = model.model.layers[0].mlp.experts
    with mock.patch.object(kernels, "fused_moe", wraps=kernels.fused_moe) as moe:
        out = Sampler([])(runner.run(chunks), requests)
    assert len(out.token_ids) == 6
    assert [c.args[0].shape[0] for c in moe.call_args_list] == [40, 40]  # both sparse layers, all 40 tokens
    assert moe.call_args_list[0].args[1] is experts.gate_up_proj


@needs_cuda
def test_on_cuda_captured_moe_graphs_generate_what_eager_steps_do(checkpoint, loaded):
    _, tokenizer = loaded
    model, config, _ = load_model(checkpoint, dtype=torch.float32, device="cuda")
    cuda = torch.device("cuda")

    def engine(**settings) -> Engine:
        return Engine(model, config, tokenizer, EngineSettings.parse(page_size=4, max_running=11, **settings), [], cuda)

    eager = engine(num_pages=256, cuda_graphs=False, overlap_schedule=False)
    fast = engine(gpu_memory_utilization=0.01)
    assert fast.runner.decode_graphs is not None and fast.runner.decode_graphs.sizes == [1, 2, 4, 8, 11]
    prompts = random_prompts(11, 1, 40, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i) for i in range(11)]
    assert token_ids(fast.generate(prompts, params)) == token_ids(eager.generate(prompts, params))


@needs_cuda
def test_on_cuda_the_fused_moe_never_waits_for_the_host():
    # A sync inside a captured graph fails the capture; here any sync raises.
    from kernels.fused_moe import fused_moe_triton
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    w13 = torch.randn(16, 256, 256, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    w2 = torch.randn(16, 256, 128, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    weights, ids = torch.softmax(torch.randn(64, 16, device="cuda", generator=g), -1).topk(4)
    fused_moe_triton(hidden, w13, w2, weights.bfloat16(), ids)  # compiles outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_moe_triton(hidden, w13, w2, weights.bfloat16(), ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@needs_cuda
def test_on_cuda_the_kv_pool_gets_what_the_expert_weights_leave(loaded):
    # Two layers of Qwen3-30B-A3B's experts (2.4 GB in bf16), so leaving them out would show.
    _, tokenizer = loaded
    config = qwen3_moe_config(
        vocab_size=VOCAB, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
        num_experts_per_tok=8, num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
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
