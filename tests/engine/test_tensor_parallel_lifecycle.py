"""Engines of several ranks as processes: a rank killed (idle, or while the engine steps) or
stopped (a hang) ends the engine with RankFailed, the hang within the collective timeout, while
ranks idle for several times that timeout are no hang; in start-up (load and warm-up), where one
rank may work alone for long, the ranks wait for each other past that timeout, and from the
first served step each gives up on the others after it; a step that raises on a rank (as it does
on rank 0, which isolates its jobs) leaves that rank serving; and on 2 GPUs, decode CUDA graphs with
the collectives captured, and the overlap scheduler, generate what one eager rank does."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from tests.engine.test_tensor_parallel import ENGINE, greedy, prompts_for
from worker.engine import Engine
from worker.engine.follower import serve_steps
from worker.engine.host_step import HostStep
from worker.engine.ranks import load_shares
from worker.engine.settings import EngineSettings
from worker.engine.step_ring import StepRing, message_bytes
from worker.model.rank_failed import RankFailed
from worker.model.tokenizer import Tokenizer


def follower_pid(engine: Engine) -> int:
    return engine.ranks.processes[0].pid


@pytest.mark.slow  # 12.5 s in the timing lane (nothing beside it), 8 s of it idle or hung past the timeout
@pytest.mark.timing
def test_ranks_idle_past_the_timeout_are_no_hang_and_a_stopped_rank_is_one(models):
    timeout_s = 2.0
    engine = Engine.from_pretrained(
        models["kv-split"], dtype="float32", tensor_parallel_size=2, tensor_parallel_timeout_s=timeout_s, **ENGINE
    )
    try:
        prompts = prompts_for(engine, seed=4)
        first = [o.token_ids for o in engine.generate(prompts, greedy(4))]
        time.sleep(3 * timeout_s)  # the other rank waits for a step all this while, and that is fine
        assert [o.token_ids for o in engine.generate(prompts, greedy(4))] == first
        os.kill(follower_pid(engine), signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RankFailed, match="tensor-parallel rank 0: .* failed"):
            engine.generate(prompts, greedy(4))
        waited = time.monotonic() - start
        assert timeout_s * 0.9 <= waited < timeout_s + 10, waited
        assert engine.ranks.failed.is_set()
        with pytest.raises(RankFailed):  # the engine stays failed
            engine.capacity()
    finally:
        engine.close()  # kills the stopped rank
    assert not engine.ranks.processes[0].is_alive()


def one_token_step() -> HostStep:
    """A decode step of token 0 at position 0, into page 0."""
    return HostStep(
        *(np.zeros(1, np.int64) for _ in range(3)),
        np.zeros((1, 1), np.int32),
        np.ones(1, np.int32),
        np.zeros(1, np.int32),
        np.array([0, 1], np.int32),
        np.zeros(1, np.int64),
        max_q_len=1,
    )


@pytest.mark.slow
@pytest.mark.timing
def test_ranks_wait_for_each_other_through_start_up_and_only_for_the_timeout_once_serving(models):
    timeout_s, alone_s = 1.0, 3.0
    settings = EngineSettings.parse(tensor_parallel_size=2, tensor_parallel_timeout_s=timeout_s, **ENGINE)
    one_rank = Engine.from_pretrained(models["kv-split"], dtype="float32", **ENGINE)
    prompts = prompts_for(one_rank, seed=6)
    expected = [o.token_ids for o in one_rank.generate(prompts, greedy(4))]
    # Engine.from_pretrained's start-up, in its parts, so that rank 0 can work alone in between.
    loaded, ranks = load_shares(models["kv-split"], "float32", "cpu", settings)
    pid = ranks.processes[0].pid
    resume = threading.Timer(alone_s, os.kill, (pid, signal.SIGCONT))
    try:
        time.sleep(alone_s)  # as loading its tokenizer: rank 1 waits in its first collective meanwhile
        tokenizer = Tokenizer.from_dir(models["kv-split"])
        engine = Engine(loaded.model, loaded.config, tokenizer, settings, [], ranks.devices[0], ranks)
        # The warm-up's lone work on rank 0 done ahead: it reaches its first collective at once.
        tokenizer.incremental_detokenizer(skip_special_tokens=True)
        os.kill(pid, signal.SIGSTOP)  # as if rank 1 worked alone: rank 0 waits in the warm-up's first collective
        resume.start()
        started = time.monotonic()
        engine.warm_up()
        assert time.monotonic() - started >= alone_s
        assert [o.token_ids for o in engine.generate(prompts, greedy(4))] == expected
        ranks.ring.send(one_token_step())  # a step rank 0 never joins: rank 1 waits in its collective
        started = time.monotonic()
        assert ranks.failed.wait(timeout_s + 10)
        waited = time.monotonic() - started
        assert ranks.failure == f"tensor-parallel rank 1 (pid {pid}) exited with code 1"
        assert timeout_s * 0.9 <= waited < timeout_s + 10, waited
    finally:
        resume.cancel()
        ranks.close()  # kills a rank still stopped


def test_a_rank_killed_mid_generation_fails_the_engine_naming_the_rank_and_the_signal(models):
    engine = Engine.from_pretrained(models["moe"], dtype="float32", tensor_parallel_size=2, **ENGINE)
    try:
        prompts = prompts_for(engine, seed=5)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{i}", prompt, greedy(40))
        engine.step()
        pid = follower_pid(engine)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RankFailed, match=rf"^tensor-parallel rank 1 \(pid {pid}\) was killed by SIGKILL$"):
            for _ in range(100):
                engine.step()
    finally:
        engine.close()


def test_a_rank_killed_while_idle_fails_the_next_call(models):
    engine = Engine.from_pretrained(models["tiny"], dtype="float32", tensor_parallel_size=2, **ENGINE)
    try:
        os.kill(follower_pid(engine), signal.SIGKILL)
        assert engine.ranks.failed.wait(10)
        with pytest.raises(RankFailed, match=r"was killed by SIGKILL"):
            engine.has_unfinished()
    finally:
        engine.close()


needs_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism on CUDA needs 2 GPUs")


@pytest.mark.cuda(gpus=2)
@needs_two_gpus
@pytest.mark.parametrize("kind", ["kv-split", "moe"])
def test_on_two_gpus_captured_graphs_and_overlap_generate_what_one_eager_rank_does(models, kind):
    prompts = [list(range(10 + i, 30 + 3 * i)) for i in range(11)]
    params = [greedy(3 + 2 * i) for i in range(11)]  # decode batches shrink 11 -> 1 through the ladder
    settings = dict(page_size=4, max_running=11, max_model_len=256)
    eager = Engine.from_pretrained(
        models[kind],
        device="cuda",
        dtype="float32",
        num_pages=256,
        cuda_graphs=False,
        overlap_schedule=False,
        **settings,
    )
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    with Engine.from_pretrained(
        models[kind], device="cuda", dtype="float32", tensor_parallel_size=2, gpu_memory_utilization=0.05, **settings
    ) as tp:
        assert tp.runner.decode_graphs is not None and tp.overlap
        assert tp.devices == ["cuda:0", "cuda:1"]
        assert [o.token_ids for o in tp.generate(prompts, params)] == expected


class FailingOnce:
    """A runner whose first step raises, as a fault of one job's inputs would on every rank."""

    device = torch.device("cpu")

    def __init__(self):
        self.steps = 0

    def execute(self, step, future=None):
        self.steps += 1
        if self.steps == 1:
            raise RuntimeError("a fault in the step's inputs")


def test_a_step_that_raises_on_a_rank_leaves_it_serving_the_next_steps(caplog):
    ring = StepRing(readers=1, capacity=message_bytes(4, 1, 1), timeout_s=5)
    reader, runner = ring.reader(0), FailingOnce()
    step = HostStep(
        *(np.zeros(n, dtype) for n, dtype in ((1, np.int64),) * 3),
        np.zeros((1, 1), np.int32),
        *(np.zeros(n, np.int32) for n in (1, 1, 2)),
        np.zeros(1, np.int64),
        max_q_len=1,
    )
    rank = threading.Thread(target=serve_steps, args=(reader, runner, 5))  # the ring has two slots
    rank.start()
    for _ in range(3):
        ring.send(step)
    ring.stop(timeout_s=5)
    rank.join(timeout=10)
    assert not rank.is_alive() and runner.steps == 3
    assert "a step failed on this rank" in caplog.text
