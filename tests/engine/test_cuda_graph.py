"""Decode CUDA graphs: the batch-size ladder, padding to it, the padded static inputs, and the
padded forward against an unpadded eager one, for a dense Qwen3 and a Qwen3-MoE (whose padding
rows are routed to experts too, sharing blocks with real rows). Capture itself needs CUDA; on
CPU the graph runner runs each padded size eagerly, which is exactly what a graph would replay."""

from unittest import mock

import pytest
import torch

from producer_client.schema import SamplingParams
from tests.engine.test_engine import random_prompts, token_ids
from worker.engine import Engine, EngineSettings
from worker.engine.cuda_graph import DecodeBuffers, DecodeGraphRunner, capture_sizes, padded_size
from worker.engine.kv_pool import pages_for
from worker.model.batch import AttentionMetadata, StepInputs
from worker.model.loader import load_model
from worker.model.tokenizer import Tokenizer

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="graph capture needs a CUDA device")
DENSE_AND_MOE = pytest.mark.parametrize("kind", ["dense", "moe"])


def engine_maker(request, kind: str):
    return request.getfixturevalue("make_engine" if kind == "dense" else "make_moe_engine")


@pytest.mark.parametrize(
    ("max_batch", "sizes"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (16, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 20]),
        (64, [1, 2, 4, 8, 16, 32, 48, 64]),
        (256, [1, 2, 4, 8] + list(range(16, 257, 16))),
    ],
)
def test_the_ladder_is_powers_of_two_to_8_then_multiples_of_16_ending_at_max_batch(max_batch, sizes):
    assert capture_sizes(max_batch) == sizes


def test_a_batch_pads_to_the_smallest_captured_size_that_holds_it():
    sizes = capture_sizes(256)
    assert [padded_size(b, sizes) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 250, 256)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        32,
        48,
        256,
        256,
    ]
    assert padded_size(257, sizes) is None
    assert all(padded_size(b, sizes) >= b for b in range(1, 257))


def decode_step(slots, page_rows, seq_lens, ids=None, positions=None) -> StepInputs:
    b = len(slots)
    width = max(len(r) for r in page_rows)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    return StepInputs(
        input_ids=torch.tensor(ids or [7 + i for i in range(b)]),
        positions=torch.tensor(positions or [s - 1 for s in seq_lens]),
        meta=AttentionMetadata(
            is_decode=True,
            slot_mapping=torch.tensor(slots),
            page_table=torch.tensor([r + [0] * (width - len(r)) for r in page_rows], dtype=torch.int32),
            seq_lens=seq,
            prefix_lens=seq - 1,
            cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
            max_q_len=1,
        ),
        sample_indices=torch.arange(b),
    )


def rows(buffers: DecodeBuffers, size: int) -> dict[str, list]:
    meta = buffers.meta(size)
    return {
        "ids": buffers.input_ids[:size].tolist(),
        "positions": buffers.positions[:size].tolist(),
        "slots": meta.slot_mapping.tolist(),
        "pages": meta.page_table.tolist(),
        "seq": meta.seq_lens.tolist(),
        "prefix": meta.prefix_lens.tolist(),
        "cu": meta.cu_seqlens_q.tolist(),
    }


def test_padding_rows_write_nothing_and_read_one_key_of_page_0():
    buffers = DecodeBuffers(max_batch=8, max_pages=4, device=CPU)
    # Three requests (contexts 5, 9 and 2 tokens, pages of 4) padded to the captured size 4.
    buffers.load(decode_step([22, 36, 12], [[5, 5], [1, 2, 9], [3]], [5, 9, 2]), size=4)
    assert rows(buffers, 4) == {
        "ids": [7, 8, 9, 0],
        "positions": [4, 8, 1, 0],
        "slots": [22, 36, 12, -1],
        "pages": [[5, 5, 0, 0], [1, 2, 9, 0], [3, 0, 0, 0], [0, 0, 0, 0]],
        "seq": [5, 9, 2, 1],
        "prefix": [4, 8, 1, 0],
        "cu": [0, 1, 2, 3, 4],
    }
    assert buffers.meta(4).is_decode and buffers.meta(4).max_q_len == 1


def test_a_smaller_batch_leaves_nothing_of_a_larger_one_in_the_rows_it_pads():
    buffers = DecodeBuffers(max_batch=8, max_pages=4, device=CPU)
    buffers.load(decode_step([1, 2, 3, 4], [[1, 2, 3, 4]] * 4, [16] * 4), size=4)
    buffers.load(decode_step([40], [[6, 7]], [6]), size=2)
    assert rows(buffers, 2) == {
        "ids": [7, 0],
        "positions": [5, 0],
        "slots": [40, -1],
        "pages": [[6, 7, 0, 0], [0, 0, 0, 0]],
        "seq": [6, 1],
        "prefix": [5, 0],
        "cu": [0, 1, 2],
    }


def test_buffers_at_rest_are_all_padding_rows():
    assert rows(DecodeBuffers(max_batch=2, max_pages=2, device=CPU), 2) == {
        "ids": [0, 0],
        "positions": [0, 0],
        "slots": [-1, -1],
        "pages": [[0, 0], [0, 0]],
        "seq": [1, 1],
        "prefix": [0, 0],
        "cu": [0, 1, 2],
    }


def start_decoding(engine, prompts: list[list[int]]) -> StepInputs:
    """Admits the prompts, runs their prefill, and returns the inputs of the decode step that follows."""
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=50))
    engine.step()
    chunks = engine.scheduler.schedule().chunks
    assert [c.num_tokens for c in chunks] == [1] * len(prompts)
    return engine.runner.prepare(chunks)


def graph_runner(engine, kv_caches, max_batch: int) -> DecodeGraphRunner:
    max_pages = pages_for(engine.max_model_len, engine.settings.page_size)
    return DecodeGraphRunner(engine.runner.model, kv_caches, max_batch, max_pages, CPU)


@pytest.mark.parametrize("batch", [3, 5, 7])
@DENSE_AND_MOE
def test_a_padded_decode_step_matches_the_unpadded_eager_one_and_padding_writes_nothing(request, kind, batch):
    engine = engine_maker(request, kind)()
    inputs = start_decoding(engine, random_prompts(batch, 3, 30, seed=batch))
    model, caches = engine.runner.model, engine.runner.kv_caches
    before = [(k.clone(), v.clone()) for k, v in caches]
    padded_caches = [(k.clone(), v.clone()) for k, v in caches]
    graphs = graph_runner(engine, padded_caches, max_batch=8)
    assert graphs.fits(inputs) and padded_size(batch, graphs.sizes) > batch

    padded = graphs.run(inputs)
    with torch.inference_mode():
        eager = model.compute_logits(model(inputs.input_ids, inputs.positions, inputs.meta, caches))
    # A GEMM's blocking depends on its row count, so padded rows change the last bits (on
    # CUDA too: cuBLAS picks kernels by shape), never the ranking.
    assert padded.shape == eager.shape == (batch, engine.vocab_size)
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))
    written = inputs.meta.slot_mapping
    for (k0, v0), (k, v), (pk, pv) in zip(before, caches, padded_caches):
        flat = [t.view(-1, *t.shape[2:]) for t in (k0, v0, k, v, pk, pv)]
        torch.testing.assert_close(flat[4][written], flat[2][written], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flat[5][written], flat[3][written], rtol=1e-5, atol=1e-5)
        untouched = torch.ones(flat[0].shape[0], dtype=torch.bool)
        untouched[written] = False
        assert torch.equal(flat[4][untouched], flat[0][untouched])  # padding rows wrote nothing
        assert torch.equal(flat[5][untouched], flat[1][untouched])


def test_every_size_writes_its_logits_into_one_buffer(make_engine):
    # On CUDA each captured graph held its own float32 [size, vocab] output (1,426 MiB for 20 sizes).
    engine = make_engine()
    graphs = graph_runner(engine, engine.runner.kv_caches, max_batch=16)
    for batch in (3, 6, 11):  # sizes 4, 8 and 16
        engine = make_engine()
        inputs = start_decoding(engine, random_prompts(batch, 3, 30, seed=batch))
        graphs.kv_caches = engine.runner.kv_caches
        logits = graphs.run(inputs)
        assert logits.shape == (batch, engine.vocab_size) and logits.dtype == torch.float32
        assert logits.data_ptr() == graphs.logits.data_ptr()
        with torch.inference_mode():
            model, caches = engine.runner.model, engine.runner.kv_caches
            eager = model.compute_logits(model(inputs.input_ids, inputs.positions, inputs.meta, caches))
        torch.testing.assert_close(logits, eager, rtol=1e-5, atol=1e-5)


def test_steps_that_are_not_plain_decodes_run_eagerly(make_engine):
    engine = make_engine()
    inputs = start_decoding(engine, random_prompts(3, 3, 30, seed=9))
    assert graph_runner(engine, engine.runner.kv_caches, max_batch=4).fits(inputs)
    assert not graph_runner(engine, engine.runner.kv_caches, max_batch=2).fits(inputs)  # more rows than the ladder
    narrow = DecodeGraphRunner(engine.runner.model, engine.runner.kv_caches, 4, 1, CPU)
    assert inputs.meta.page_table.shape[1] > 1 and not narrow.fits(inputs)
    extend = StepInputs(inputs.input_ids, inputs.positions, inputs.meta, inputs.sample_indices)
    extend.meta = AttentionMetadata(**{**vars(inputs.meta), "is_decode": False})
    assert not graph_runner(engine, engine.runner.kv_caches, max_batch=4).fits(extend)


@DENSE_AND_MOE
def test_an_engine_replaying_padded_decodes_generates_what_the_eager_engine_does(request, kind):
    make_engine = engine_maker(request, kind)
    prompts = random_prompts(11, 1, 40, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i) for i in range(11)]  # batches shrink 11 -> 1
    expected = token_ids(make_engine().generate(prompts, params))
    engine = make_engine(max_running=11)
    graphs = graph_runner(engine, engine.runner.kv_caches, max_batch=11)
    engine.runner.decode_graphs = graphs
    with mock.patch.object(graphs, "run", wraps=graphs.run) as replays:
        assert token_ids(engine.generate(prompts, params)) == expected
    batches = {call.args[0].input_ids.shape[0] for call in replays.call_args_list}
    assert batches == set(range(1, 12))  # every decode step, at every batch size, went through the graphs


@pytest.mark.cuda
@needs_cuda
@DENSE_AND_MOE
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_on_cuda_captured_graphs_and_overlap_generate_what_eager_synchronous_steps_do(request, kind, kv_cache_dtype):
    checkpoint = request.getfixturevalue("checkpoint" if kind == "dense" else "moe_checkpoint")
    tokenizer = Tokenizer.from_dir(checkpoint)
    model, config, _ = load_model(checkpoint, dtype=torch.float32, device="cuda")
    cuda = torch.device("cuda")

    def engine(**settings) -> Engine:
        settings = EngineSettings.parse(page_size=4, max_running=11, kv_cache_dtype=kv_cache_dtype, **settings)
        return Engine(model, config, tokenizer, settings, [], cuda)

    eager = engine(num_pages=256, cuda_graphs=False, overlap_schedule=False)
    # CUDA's defaults: a profiled pool (a small share: the tiny model's pages are tiny), graphs, overlap.
    fast = engine(gpu_memory_utilization=0.01)
    assert fast.runner.decode_graphs is not None and fast.runner.decode_graphs.sizes == [1, 2, 4, 8, 11]
    assert fast.overlap and fast.allocator.num_pages > 256
    prompts = random_prompts(11, 1, 40, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i) for i in range(11)]
    params[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=9)
    params[4] = SamplingParams(temperature=0, max_tokens=9, repetition_penalty=1.2, logprobs=2)
    assert token_ids(fast.generate(prompts, params)) == token_ids(eager.generate(prompts, params))
