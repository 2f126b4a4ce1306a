"""KV pool sizing: bytes per token, the budget left after activations, pages in it, and the
profiling step. Only reading CUDA's memory counters needs a GPU; here they are stood in for."""

import logging

import pytest
import torch

from worker.engine.errors import KVCacheTooSmall
from worker.engine.kv_pool import KVCacheShape, allocate_kv_caches
from worker.engine.memory import kv_budget_bytes, kv_cache_pages, pages_in_budget, profile_batch
from worker.engine.runner import ModelRunner
from worker.engine.sampler import Sampler
from worker.engine.settings import EngineSettings
from worker.model.presets import PRESETS

GiB = 2**30
QWEN3_06B = KVCacheShape(num_layers=28, num_kv_heads=8, head_dim=128, page_size=16, dtype=torch.bfloat16)


def test_a_token_costs_k_and_v_in_every_layer():
    assert QWEN3_06B.bytes_per_token == 2 * 28 * 8 * 128 * 2 == 114_688
    assert QWEN3_06B.bytes_per_page == 16 * 114_688 == 1_835_008
    tiny = PRESETS["tiny"].config
    shape = KVCacheShape(tiny["num_hidden_layers"], tiny["num_key_value_heads"], tiny["head_dim"], 4, torch.float32)
    assert shape.bytes_per_token == 2 * tiny["num_hidden_layers"] * tiny["num_key_value_heads"] * tiny["head_dim"] * 4


def test_the_budget_is_the_utilized_share_of_free_memory_less_the_activation_peak():
    assert kv_budget_bytes(77 * GiB, 0.85, 0) == int(77 * GiB * 0.85)
    assert kv_budget_bytes(77 * GiB, 0.85, 3 * GiB) == int(77 * GiB * 0.85) - 3 * GiB
    assert kv_budget_bytes(4 * GiB, 0.5, 3 * GiB) == -GiB  # the activations need more than the share


def test_pages_are_whole_pages_of_the_budget_and_at_least_one():
    assert pages_in_budget(int(77 * GiB * 0.85) - 3 * GiB, QWEN3_06B.bytes_per_page) == 36_542
    assert pages_in_budget(1_835_008, 1_835_008) == 1
    for budget in (1_835_007, 0, -GiB):
        with pytest.raises(KVCacheTooSmall, match="hold no page of 1835008 bytes"):
            pages_in_budget(budget, QWEN3_06B.bytes_per_page)


def never_profiled() -> int:
    raise AssertionError("profiled a pool that is not sized from GPU memory")


def test_explicit_pages_win_and_cpu_pools_take_kv_cache_mib_without_profiling():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert kv_cache_pages(QWEN3_06B, cuda, EngineSettings(num_pages=7), never_profiled) == 7
    assert kv_cache_pages(QWEN3_06B, cpu, EngineSettings(kv_cache_mib=35), never_profiled) == 20  # 35 MiB / 1.75 MiB
    with pytest.raises(KVCacheTooSmall):
        kv_cache_pages(QWEN3_06B, cpu, EngineSettings(kv_cache_mib=1), never_profiled)


def test_a_cuda_pool_is_sized_after_the_profiled_peak_and_logged_as_pages_times_page_size(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (77 * GiB, 80 * GiB))
    settings = EngineSettings(gpu_memory_utilization=0.85)
    with caplog.at_level(logging.INFO, logger="worker.engine.memory"):
        pages = kv_cache_pages(QWEN3_06B, torch.device("cuda"), settings, lambda: 3 * GiB)
    assert pages == (int(77 * GiB * 0.85) - 3 * GiB) // QWEN3_06B.bytes_per_page == 36_542
    assert f"KV cache: 36542 pages x 16 tokens = {36_542 * 16} tokens" in caplog.text
    assert "less an activation peak of 3.00 GiB" in caplog.text


def test_the_profiled_step_is_the_token_budget_split_evenly_over_max_running_sequences():
    requests, chunks = profile_batch(EngineSettings(max_num_batched_tokens=10, max_running=4, page_size=2), 100)
    assert [len(r.token_ids) for r in requests] == [3, 3, 2, 2]
    assert [r.pages for r in requests] == [[0, 1], [2, 3], [4], [5]]
    assert [(c.request, c.start, c.num_tokens, c.samples) for c in chunks] == [
        (r, 0, len(r.token_ids), True) for r in requests
    ]
    requests, _ = profile_batch(EngineSettings(max_num_batched_tokens=4096, max_running=256), 151_936)
    assert {len(r.token_ids) for r in requests} == {16} and len(requests) == 256


def test_under_speculative_decoding_the_profiled_step_samples_at_each_sequences_last_k_plus_1_tokens(loaded):
    settings = EngineSettings(
        max_num_batched_tokens=40, max_running=6, page_size=4, speculative_method="ngram", num_speculative_tokens=2
    )
    rows, chunks = profile_batch(settings, 100)
    assert [c.num_sampled for c in chunks] == [3] * 6 and len(rows) == 18
    assert all(c.input_ids == c.request.token_ids for c in chunks)  # the draft is the sequence's own tail
    (model, config, _), _ = loaded
    shape = KVCacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4, torch.float32)
    cpu = torch.device("cpu")
    runner = ModelRunner(model, allocate_kv_caches(shape, sum(len(c.request.pages) for c in chunks), cpu), 4, cpu)
    assert len(Sampler([])(runner.run(chunks), rows).token_ids) == 18


def test_the_profiled_step_runs_through_the_model_and_every_sampling_feature(loaded):
    (model, config, _), _ = loaded
    settings = EngineSettings(max_num_batched_tokens=40, max_running=6, page_size=4)
    requests, chunks = profile_batch(settings, config.vocab_size)
    shape = KVCacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 4, torch.float32)
    cpu = torch.device("cpu")
    runner = ModelRunner(model, allocate_kv_caches(shape, sum(len(r.pages) for r in requests), cpu), 4, cpu)
    out = Sampler([])(runner.run(chunks), requests)
    assert len(out.token_ids) == 6 and all(len(lp.top) == 20 for lp in out.logprobs)
