"""Verify steps laid out for CUDA graphs: every request at k + 1 query tokens, padding after a
shorter draft that writes no KV and returns no logits, the batch padded to the decode ladder. On
CPU the graph runner runs each padded size eagerly, which is what a captured graph replays; on
CUDA the engine captures them and replays them with overlap on."""

from unittest import mock

import pytest
import torch

from producer_client.schema import SamplingParams
from tests.engine.speculative_support import AlwaysSpeculate, known_outputs, speculative
from tests.engine.support import VOCAB
from tests.engine.test_engine import random_prompts
from tests.engine.test_speculative import assert_same_outputs
from worker.engine.kv_pool import pages_for
from worker.engine.scheduler import ScheduledChunk
from worker.engine.verify_graphs import VerifyGraphRunner, padded_verify_step

CPU = torch.device("cpu")
K = 4


def verify_graphs(engine, max_batch: int) -> VerifyGraphRunner:
    pages = pages_for(engine.max_model_len + K + 1, engine.settings.page_size)
    return VerifyGraphRunner(engine.runner.model, engine.runner.kv_caches, max_batch, pages, K + 1, CPU)


def test_a_padded_verify_step_puts_padding_after_each_draft_writing_nothing(make_engine):
    engine = make_engine()
    prompts = random_prompts(2, 6, 6, seed=2)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=20))
    engine.step()
    chunks = []
    for req, draft in zip(engine.scheduler.running, ([3, 4], [])):
        engine.scheduler.pages.reserve_draft(req, len(draft))
        chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1 + len(draft), True, draft))
    step = padded_verify_step(engine.scheduler.page_table, 4, chunks, K + 1)
    assert step.input_ids.tolist() == [chunks[0].input_ids[0], 3, 4, 0, 0, chunks[1].input_ids[0], 0, 0, 0, 0]
    assert step.positions.tolist() == [6, 7, 8, 8, 8, 6, 6, 6, 6, 6]  # padding at the last real position
    assert (step.slot_mapping[[3, 4, 6, 7, 8, 9]] == -1).all() and (step.slot_mapping[[0, 1, 2, 5]] >= 0).all()
    assert step.sample_indices.tolist() == [0, 1, 2, 5] and step.cu_seqlens_q.tolist() == [0, 5, 10]
    assert verify_graphs(engine, 4).fits(step)


@pytest.mark.parametrize("settings", [{}, {"overlap_schedule": True}], ids=["sync", "overlap"])
def test_an_engine_replaying_padded_verify_steps_generates_what_it_does_without_speculation(make_engine, settings):
    prompts = random_prompts(7, 1, 40, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i) for i in range(7)]  # batches shrink 7 -> 1
    params[2] = SamplingParams(temperature=0.9, seed=4, max_tokens=10, logprobs=2)
    want, known = known_outputs(make_engine(**settings), prompts, params)
    engine = speculative(make_engine, known, VOCAB, lambda p: p % 3 == 1, k=K, max_running=8, **settings)
    graphs = engine.runner.verify_graphs = verify_graphs(engine, max_batch=8)
    with mock.patch.object(graphs, "run", wraps=graphs.run) as replays:
        assert_same_outputs(engine.generate(prompts, params), want)
    assert {call.args[0].meta.prefix_lens.shape[0] for call in replays.call_args_list} >= {1, 7}


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a CUDA device")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_on_cuda_captured_verify_graphs_and_overlap_generate_what_eager_plain_steps_do(checkpoint, kv_cache_dtype):
    from worker.engine import Engine

    def engine(**settings):
        return Engine.from_pretrained(
            checkpoint,
            device="cuda",
            dtype="float32",
            page_size=4,
            max_running=8,
            kv_cache_dtype=kv_cache_dtype,
            **settings,
        )

    prompts = random_prompts(7, 1, 40, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i) for i in range(7)]
    params[2] = SamplingParams(temperature=0.9, seed=4, max_tokens=10, logprobs=2)
    want = engine(num_pages=256, cuda_graphs=False, overlap_schedule=False).generate(prompts, params)
    fast = engine(gpu_memory_utilization=0.01, speculative_method="draft", speculative_model=str(checkpoint))
    assert fast.runner.verify_graphs is not None and fast.overlap
    fast.speculator.adaptive = AlwaysSpeculate()
    with mock.patch.object(fast.runner.verify_graphs, "run", wraps=fast.runner.verify_graphs.run) as replays:
        assert_same_outputs(fast.generate(prompts, params), want)
    assert replays.call_count > 0 and fast.stats().accepted_draft_tokens > 0
