"""Speculative decoding with cache-aware placement, through the whole service: two workers on the
tiny preset drafting by n-gram lookup (which its looping output makes accepted), placement on, the
real client. A conversation's second turn is placed on the worker that ran its first, and finds
there in the prefix cache exactly the pages that the engine without speculation keeps: only
accepted tokens' KV was cached, and every output is the one the engine gives without speculation."""

from __future__ import annotations

import uuid

import pytest
import torch

from harness.polling import eventually
from producer_client import SamplingParams
from producer_client.connection import connect
from producer_client.keys import Keys
from producer_client.placement import Placed, Placement
from producer_client.schema import JobRequest
from tests.chaos.test_feature_matrix import taken
from tests.chaos.test_kill import counter
from tests.support.clients import make_client
from tests.support.fixtures import SERVER_ONLY
from tests.support.workers import WorkerProcess, start_workers
from worker.loop.intake import render_prompt

KEYS = Keys()
ENGINE = dict(max_running=4, max_model_len=256, page_size=4)
SPECULATIVE = dict(speculative_method="ngram", num_speculative_tokens=4)
SYSTEM = {"role": "system", "content": "You answer in one line."}
FIRST_TURNS = [[SYSTEM, {"role": "user", "content": f"Say something about the number {i * 13}."}] for i in range(4)]
PARAMS = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


def flags(settings: dict) -> list[str]:
    return [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]


def second_turn(first: list[dict], answer: str) -> list[dict]:
    return [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]


def without_speculation(rounds: list[list[list[dict]]]) -> list[list]:
    """Each round of conversations through one engine without speculation, in order, rendered as
    the workers render them: the outputs, with their cached prompt tokens (one thread, like the
    workers)."""
    from worker.engine.engine import Engine

    engine = Engine.from_pretrained("tiny", kv_cache_mib=64, **ENGINE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        outputs = []
        for chats in rounds:
            prompts = [render_prompt(JobRequest(messages=m), engine.tokenizer)[0] for m in chats]
            outputs.append(engine.generate(prompts, SamplingParams(**PARAMS)))
        return outputs
    finally:
        torch.set_num_threads(threads)


def deployment_worker(deployment, job_id: str) -> str:
    return connect(deployment.url, decode_responses=True).hget(KEYS.job(job_id), "worker")


@pytest.mark.slow
@SERVER_ONLY
def test_a_placed_second_turn_hits_the_speculating_workers_cache_of_accepted_tokens(redis_deployment, tmp_path):
    queue = f"spec-placed-{uuid.uuid4().hex[:6]}"
    workers = start_workers(
        [
            WorkerProcess(redis_deployment.url, queue, f"{queue}-{n}", tmp_path, *flags(ENGINE | SPECULATIVE))
            for n in "ab"
        ]
    )
    try:
        # Ready is the process's word; placement sees a worker once its heartbeat says it serves, and
        # places by the load the heartbeats report.
        admin = connect(redis_deployment.url, decode_responses=True)

        def idle_in_view() -> bool:
            beats = [admin.hgetall(KEYS.worker(w.name)) for w in workers]
            return all(b.get("state") == "serving" and b.get("running") == "0" for b in beats)

        assert eventually(idle_in_view)
        with make_client("sync", redis_deployment.url, queue) as client:
            # A fresh view for every job: a cached one still counts the first turns as the workers'
            # load when the second turns come, and the bound sends some of them to the other worker.
            client.placement = Placement(refresh_s=0)
            first_ids = [client.submit(messages=m, **PARAMS) for m in FIRST_TURNS]
            first = [client.result(job_id, timeout=120) for job_id in first_ids]
            second_turns = [second_turn(m, r.text) for m, r in zip(FIRST_TURNS, first)]
            # Placement sends a job past a worker whose heartbeat still counts the first turns as
            # running: the second turns go once both say they are idle again.
            assert eventually(idle_in_view)
            second_ids = [client.submit(messages=m, **PARAMS) for m in second_turns]
            second = [client.result(job_id, timeout=120) for job_id in second_ids]
            placed = dict(client.placement.placed)
        want_first, want_second = without_speculation([FIRST_TURNS, second_turns])
        assert [r.token_ids for r in first] == [w.token_ids for w in want_first]
        assert [r.token_ids for r in second] == [w.token_ids for w in want_second]
        cached = [r.usage.cached_prompt_tokens for r in second]
        assert cached == [w.usage.cached_prompt_tokens for w in want_second] and min(cached) > 0
        assert {how: n for how, n in placed.items() if n} == {Placed.AFFINITY: 8}
        ran_on = [deployment_worker(redis_deployment, job_id) for job_id in first_ids + second_ids]
        assert ran_on[4:] == ran_on[:4]  # each second turn where its first ran
        assert sum(taken(w)["own"] for w in workers) == 8
        assert sum(counter(w, "mili_speculative_accepted_tokens") for w in workers) > 0
    finally:
        for w in workers:
            w.stop()
