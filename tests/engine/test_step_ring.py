"""The shared-memory ring that carries each step's inputs from rank 0 to the other ranks: a step
arrives whole, in order, in the slot size the largest step needs; a reader that reads no more
makes the writer give up after its timeout (a hang), never wait forever: the start-up's until
SERVE has gone out, the served steps' after."""

import multiprocessing
import time

import numpy as np
import pytest

from worker.engine.host_step import HostStep
from worker.engine.kv_pool import pages_for
from worker.engine.lora.rows import LoraRows
from worker.engine.settings import EngineSettings
from worker.engine.step_ring import SLOTS, AdapterMessage, Kind, StepRing, message_bytes, ring_capacity
from worker.model.rank_failed import RankFailed


def host_step(seed: int, tokens: int, rows: int, width: int, samples: int) -> HostStep:
    rng = np.random.default_rng(seed)

    def ints(n, dtype, low=-5):
        return rng.integers(low, 2**30, n).astype(dtype)

    return HostStep(
        ints(tokens, np.int64),
        ints(tokens, np.int64),
        ints(tokens, np.int64),
        ints(rows * width, np.int32).reshape(rows, width),
        ints(rows, np.int32),
        ints(rows, np.int32),
        ints(rows + 1, np.int32),
        ints(samples, np.int64),
        max_q_len=int(rng.integers(1, 9)),
    )


def assert_same(a: HostStep, b: HostStep) -> None:
    for name, value in vars(a).items():
        other = getattr(b, name)
        if isinstance(value, np.ndarray):
            assert other.dtype == value.dtype and other.shape == value.shape, name
            assert np.array_equal(other, value), name
        elif isinstance(value, LoraRows):
            assert all(np.array_equal(x, y) and x.dtype == y.dtype for x, y in zip(value, other)), name
        else:
            assert other == value, name


SHAPES = [(1, 1, 1, 1), (7, 3, 5, 2), (13, 13, 1, 13), (64, 64, 9, 64), (3, 1, 0, 1)]


def test_steps_arrive_whole_and_in_order_with_their_draws_count():
    ring = StepRing(readers=2, capacity=message_bytes(64, 64, 9), timeout_s=5)
    readers = [ring.reader(0), ring.reader(1)]
    for i, shape in enumerate(SHAPES):
        step = host_step(i, *shape)
        ring.send(step, future_rows=i)
        for reader in readers:  # every reader gets every message, each once
            message = reader.receive()
            assert message.kind is Kind.STEP and message.future_rows == i
            assert_same(message.step, step)
    ring.stop(timeout_s=1)
    assert [r.receive().kind for r in readers] == [Kind.STOP, Kind.STOP]


def test_a_slot_holds_the_largest_step_and_a_larger_one_is_refused():
    ring = StepRing(readers=1, capacity=message_bytes(32, 8, 4), timeout_s=5)
    reader = ring.reader(0)
    largest = host_step(0, 32, 8, 4, 32)  # every token samples, as in a step that verifies drafts
    ring.send(largest)
    assert_same(reader.receive().step, largest)
    with pytest.raises(ValueError, match="overflows the ring's"):
        ring.send(host_step(1, 32, 8, 5, 32))


def test_a_slot_holds_a_verify_step_laid_out_for_its_graphs_past_the_token_budget_on_adapters():
    settings = EngineSettings.parse(
        page_size=4,
        max_running=64,
        max_num_batched_tokens=256,
        speculative_method="ngram",
        num_speculative_tokens=16,
        lora_modules={"sql": "/adapters/sql"},
        max_loras=3,
    )
    ring = StepRing(readers=1, capacity=ring_capacity(settings, max_model_len=100), timeout_s=5)
    q = 17  # every running request at k + 1 tokens, 1,088 in all; the page table past the last position
    verify = host_step(0, 64 * q, 64, pages_for(99 + q, 4), 64 * q)
    verify.lora = LoraRows.of(np.arange(64) % 3, np.full(64, q), 3)
    ring.send(verify)
    assert_same(ring.reader(0).receive().step, verify)


def test_a_steps_adapter_rows_and_the_adapters_to_read_and_install_cross_the_ring_in_order():
    ring = StepRing(readers=1, capacity=message_bytes(32, 8, 4, lora_slots=3), timeout_s=5)
    reader = ring.reader(0)
    with_rows = host_step(0, 32, 8, 4, 8)
    with_rows.lora = LoraRows.of(np.array([2, -1, 0, 2, -1, 1, 0, 2]), np.array([4] * 8), 3)
    sent = [
        (Kind.ADAPTER_READ, AdapterMessage(-1, "sql", "/adapters/sql")),
        (Kind.ADAPTER_INSTALL, AdapterMessage(2, "sql", "/adapters/sql")),
    ]
    for kind, adapter in sent:  # as many as the ring has slots, then read
        ring.send_adapter(kind, adapter)
    for kind, adapter in sent:
        message = reader.receive()
        assert (message.kind, message.adapter, message.step) == (kind, adapter, None)
    ring.send(with_rows)
    ring.send(host_step(1, 5, 2, 3, 2))  # a step with no adapter rows after it
    assert_same(reader.receive().step, with_rows)
    assert reader.receive().step.lora is None


def read_in_another_process(reader, count: int, results) -> None:
    for _ in range(count):
        message = reader.receive()
        results.put((int(message.step.input_ids.sum()), message.step.page_table.shape))


def test_a_reader_in_another_process_reads_what_the_writer_wrote_while_the_writer_runs_ahead():
    ring = StepRing(readers=1, capacity=message_bytes(100, 10, 10), timeout_s=30)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    process = ctx.Process(target=read_in_another_process, args=(ring.reader(0), 20, results))
    process.start()
    steps = [host_step(i, 1 + i * 4, 1 + i % 10, 1 + i % 7, 1) for i in range(20)]
    for step in steps:
        ring.send(step)
    got = [results.get(timeout=60) for _ in steps]
    process.join(timeout=60)
    assert got == [(int(s.input_ids.sum()), s.page_table.shape) for s in steps]


@pytest.mark.timing
def test_the_writer_gives_up_after_its_timeout_on_a_reader_that_reads_no_more():
    ring = StepRing(readers=1, capacity=message_bytes(4, 1, 1), timeout_s=0.2)
    for i in range(SLOTS):  # the slots fill without a wait
        ring.send(host_step(i, 4, 1, 1, 1))
    for _ in range(3):  # each try runs its whole timeout, and only that
        assert 0.2 <= timed_out_send(ring, 0.2) < 2


def timed_out_send(ring: StepRing, timeout_s: float) -> float:
    start = time.monotonic()
    with pytest.raises(RankFailed, match=rf"rank 1 has read no step for {timeout_s:g} s: it hangs"):
        ring.send(host_step(9, 4, 1, 1, 1))
    return time.monotonic() - start


@pytest.mark.timing
def test_the_writer_waits_the_start_up_timeout_until_serve_then_the_served_one():
    ring = StepRing(readers=1, capacity=message_bytes(4, 1, 1), timeout_s=1.0)
    reader = ring.reader(0)
    for i in range(SLOTS):
        ring.send(host_step(i, 4, 1, 1, 1))
    assert 1.0 <= timed_out_send(ring, 1.0) < 3
    reader.receive()  # a free slot for SERVE
    ring.serve(0.2)
    assert [reader.receive().kind for _ in range(SLOTS)] == [Kind.STEP, Kind.SERVE]
    for i in range(SLOTS):
        ring.send(host_step(i, 4, 1, 1, 1))
    for _ in range(3):
        assert 0.2 <= timed_out_send(ring, 0.2) < 2
