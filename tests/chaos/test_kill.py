"""kill -9 one of two workers while it generates 20 greedy jobs on the tiny model: every job
completes with exactly one final result and the output a fault-free run gives, and the event
streams show that no token recorded before the kill was generated again: the surviving worker
resumed each job right after the tokens the dead one had published. On one server, and on a
cluster with the queue spread over three shards, one on each master (`--queue-shards 3`: the
survivor reclaims the victim's entries in every shard, the jobs' keys on every master); Sentinel's
master is one server to the workers."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request
import uuid

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from redis.cluster import RedisCluster

from harness.polling import eventually
from producer_client import SamplingParams
from producer_client.keys import Keys
from producer_client.protocol.shards import shard_of
from tests.support.clients import make_client
from tests.support.fixtures import on_modes
from tests.support.jobs import assert_one_final_result, queue_depth, queue_pending, runs, tokens_published
from tests.support.workers import WorkerProcess, start_workers

KEYS = Keys()
ENGINE = dict(max_running=8, max_model_len=256)
# Recovery settings: fast, yet a survivor starved of CPU for a moment on a busy 2-core machine
# must not look dead to the victim before the kill (a takeover would be right, but muddle the
# counts this test checks). Tokens are recorded many times over during a 32-token job, so the kill
# lands between checkpoints of jobs still running (at the default 1 s a job can end before its
# second checkpoint, and the victim be found generating only once its jobs are done).
RECLAIM = dict(claim_idle_ms=2000, reclaim_interval_s=0.2, checkpoint_interval_s=0.1)
PROMPTS = [f"Job {i}: tell me something about the number {i * 7}." for i in range(20)]
# Greedy; every other job with a repetition penalty, which resumed tokens must feed like any output.
PARAMS = [
    dict(max_tokens=32, temperature=0.0, ignore_eos=True, repetition_penalty=1.3 if i % 2 else 1.0) for i in range(20)
]


def generate_alone(prompts: list[str], params: list[dict]) -> list:
    """The outputs of an uninterrupted run: the engine in this process, one thread like the workers."""
    from worker.engine.engine import Engine

    engine = Engine.from_pretrained("tiny", kv_cache_mib=64, **ENGINE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return engine.generate([engine.tokenizer.encode(p) for p in prompts], [SamplingParams(**p) for p in params])
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def fault_free():
    return generate_alone(PROMPTS, PARAMS)


SHARDS_ON_A_CLUSTER = 3  # the test cluster's masters


def spread_queue(redis_client, shards: int) -> str:
    """A fresh queue name; on a cluster, one whose shards' hash tags lie on as many masters."""
    while True:
        queue = f"kill-{uuid.uuid4().hex[:6]}"
        if shards == 1:
            return queue
        streams = [KEYS.queue(KEYS.shard(queue, i)) for i in range(shards)]
        if len({redis_client.get_node_from_key(stream).name for stream in streams}) == shards:
            return queue


def counter(worker: WorkerProcess, name: str) -> float:
    port = int(worker.heartbeat()["metrics_port"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == name)
    return next(s.value for s in family.samples if s.name == f"{name}_total")


def generated_tokens(worker: WorkerProcess) -> float:
    return counter(worker, "mili_generation_tokens")


@pytest.mark.slow
@on_modes("server", "cluster")
def test_kill_9_mid_generation_loses_no_job_and_regenerates_no_recorded_token(
    redis_deployment, deployment_client, fault_free, tmp_path
):
    shards = SHARDS_ON_A_CLUSTER if isinstance(deployment_client, RedisCluster) else 1
    queue = spread_queue(deployment_client, shards)
    settings = {**ENGINE, **RECLAIM, "queue_shards": shards}
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in settings.items()]
    victim, survivor = start_workers(
        [WorkerProcess(redis_deployment.url, queue, f"{queue}-{n}", tmp_path, *flags) for n in ("victim", "survivor")]
    )
    try:
        with make_client("sync", redis_deployment.url, queue, queue_shards=shards) as client:
            ids = [client.submit(p, **params) for p, params in zip(PROMPTS, PARAMS)]

            def victim_generating() -> bool:
                jobs = [deployment_client.hmget(KEYS.job(j), "worker", "status", "tokens") for j in ids]
                return sum(w == victim.name and s == "running" and int(t or 0) >= 4 for w, s, t in jobs) >= 2

            assert eventually(victim_generating, timeout=120), victim.log()
            victim.process.kill()
            killed_at = time.time()
            victim.process.wait()
            results = [client.result(job_id, timeout=180) for job_id in ids]
        victim_tokens = resumed_after = 0
        recoveries, resumed_shards = [], set()
        for job_id, result, want in zip(ids, results, fault_free):
            assert (result.status, result.finish_reason) == ("done", "length"), job_id
            assert (result.token_ids, result.text) == (want.token_ids, want.text), job_id
            assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(want.prompt_token_ids), 32)
            assert_one_final_result(deployment_client, job_id)
            assert tokens_published(deployment_client, job_id) == result.token_ids  # each token once, none missing
            job_runs = runs(deployment_client, job_id)
            made_before = 0
            for start, made in job_runs:
                assert start["resumed_tokens"] == made_before  # each run starts after what was recorded
                made_before += len(made)
            *earlier, (last, _) = job_runs
            assert last["worker"] == result.worker
            victim_tokens += sum(len(made) for start, made in job_runs if start["worker"] == victim.name)
            if earlier:  # the victim's, cut short by the kill
                assert {start["worker"] for start, _ in earlier} == {victim.name} and last["worker"] == survivor.name
                resumed_after += last["resumed_tokens"]
                recoveries.append(last["at"] - killed_at)
                resumed_shards.add(shard_of(job_id, shards))
        assert recoveries and resumed_after > 0
        # The survivor generated exactly the tokens the victim had not recorded: none twice.
        assert eventually(lambda: generated_tokens(survivor) == 32 * 20 - victim_tokens)
        # Entries are acknowledged just after their results are written.
        assert eventually(lambda: queue_depth(deployment_client, queue) == 0)
        assert queue_pending(deployment_client, queue) == 0
        print(
            f"\nkill -9: {len(recoveries)} jobs resumed after {resumed_after} recorded tokens; recovery "
            f"(kill to the survivor's start) {min(recoveries):.2f}-{max(recoveries):.2f}s with {RECLAIM}, "
            f"heartbeat_interval_s 0.1; their shards {sorted(resumed_shards)} of {shards}"
        )
    finally:
        victim.stop()
        survivor.stop()


# Kill -9 mid-stream: intervals at which a 120-token job publishes many times over.
STREAMING = dict(stream_interval_s=0.05, checkpoint_interval_s=0.25)
STREAM_PARAMS = dict(max_tokens=120, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def fault_free_long():
    return generate_alone(PROMPTS[:8], [STREAM_PARAMS] * 8)


@pytest.mark.slow
@pytest.mark.timing
def test_kill_9_mid_stream_loses_at_most_one_publish_interval_and_readers_see_each_token_once(
    redis_server,
    redis_client,
    fault_free_long,
    tmp_path,
):
    """Eight greedy jobs, four streamed (read by stream() throughout), four not, run on one worker
    in lockstep (a token each per step). The worker is frozen (SIGSTOP) and killed (SIGKILL) mid-run;
    just before, its generation counter and pace are read. What it had generated and not recorded is
    at most one publish interval of steps per job, give or take the round out and a step; a second
    worker resumes each job after its recorded tokens; every reader's deltas add up to the output
    of a fault-free run, no token twice."""
    queue = f"kill-stream-{uuid.uuid4().hex[:6]}"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in {**ENGINE, **RECLAIM, **STREAMING}.items()]
    victim = WorkerProcess(redis_server.url, queue, f"{queue}-victim", tmp_path, *flags)
    survivor = WorkerProcess(redis_server.url, queue, f"{queue}-survivor", tmp_path, *flags)
    try:
        with make_client("sync", redis_server.url, queue) as client:
            ids = [client.submit(p, stream=i < 4, **STREAM_PARAMS) for i, p in enumerate(PROMPTS[:8])]
            read: dict[str, list] = {job_id: [] for job_id in ids[:4]}
            readers = [threading.Thread(target=lambda j=j: read[j].extend(client.stream(j, timeout=180))) for j in read]
            for reader in readers:
                reader.start()
            start_workers([victim])  # it takes all eight at once: they step together
            recorded = lambda: [int(redis_client.hget(KEYS.job(j), "tokens") or 0) for j in ids]  # noqa: E731
            assert eventually(lambda: min(recorded()) >= 15, timeout=120), victim.log()
            made_then, then = generated_tokens(victim), time.monotonic()
            time.sleep(0.5)
            made_now, now = generated_tokens(victim), time.monotonic()
            victim.process.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            time.sleep(0.3)  # what it had sent reaches Redis
            kept = recorded()
            victim.process.kill()
            victim.process.wait()
            start_workers([survivor])
            results = [client.result(job_id, timeout=180) for job_id in ids]
            for reader in readers:
                reader.join(60)
        step_s = (now - then) / ((made_now - made_then) / 8)
        made = made_now / 8 + 1 + (stopped_at - now) / step_s  # per job, at most, when it froze
        for i, (job_id, result, want) in enumerate(zip(ids, results, fault_free_long)):
            assert (result.token_ids, result.text) == (want.token_ids, want.text), job_id
            assert tokens_published(redis_client, job_id) == result.token_ids  # each token once
            (first, _), (second, _) = runs(redis_client, job_id)
            assert (first["worker"], second["worker"], second["resumed_tokens"]) == (
                victim.name,
                survivor.name,
                kept[i],
            )
            interval = STREAMING["stream_interval_s" if i < 4 else "checkpoint_interval_s"]
            lost = made - kept[i]
            print(
                f"job {i} ({'streamed' if i < 4 else 'not streamed'}): lost {lost:.1f} tokens at most, "
                f"{lost * step_s * 1000:.0f} ms of steps ({step_s * 1000:.1f} ms each)"
            )
            assert lost <= interval / step_s + 3
            if job_id in read:
                assert "".join(d.text for d in read[job_id]) == result.text
                assert [t for d in read[job_id] for t in d.token_ids] == result.token_ids
    finally:
        victim.stop()
        survivor.stop()


# Speculative decoding: n-gram drafts, which the tiny model's looping output makes accepted, so a
# step publishes several tokens of a job at once; greedy and seeded jobs, and one that opts out.
SPECULATIVE = dict(speculative_method="ngram", num_speculative_tokens=4)
SPEC_PROMPTS = PROMPTS[:8]
SPEC_PARAMS = [
    dict(max_tokens=48, ignore_eos=True, **({"temperature": 0.0} if i % 2 else {"temperature": 0.8, "seed": i}))
    for i in range(8)
]
SPEC_PARAMS[3] = {**SPEC_PARAMS[3], "speculative": False}


def generating_worker(redis_client, workers: list[WorkerProcess], ids: list[str]) -> WorkerProcess | None:
    """The first of `workers` running two of the jobs or more, each with four recorded tokens or more;
    None while none is. Which worker runs a job is placement's choice, by the hash of its prompt and
    the worker's name (which holds the queue's random name): a given worker of two gets one of 8 jobs
    or none for 3.6% of names, but one of them gets four at least, and runs them together."""
    jobs = [redis_client.hmget(KEYS.job(j), "worker", "status", "tokens") for j in ids]
    for worker in workers:
        if sum(w == worker.name and s == "running" and int(t or 0) >= 4 for w, s, t in jobs) >= 2:
            return worker
    return None


@pytest.mark.slow
@on_modes("server")
def test_kill_9_mid_speculative_generation_resumes_each_job_to_the_fault_free_output(
    redis_deployment, deployment_client, tmp_path
):
    fault_free = generate_alone(SPEC_PROMPTS, SPEC_PARAMS)  # without speculation
    queue = f"kill-spec-{uuid.uuid4().hex[:6]}"
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in {**ENGINE, **RECLAIM, **SPECULATIVE}.items()]
    workers = start_workers(
        [WorkerProcess(redis_deployment.url, queue, f"{queue}-{n}", tmp_path, *flags) for n in ("a", "b")]
    )
    try:
        with make_client("sync", redis_deployment.url, queue) as client:
            ids = [client.submit(p, **params) for p, params in zip(SPEC_PROMPTS, SPEC_PARAMS)]
            victim = eventually(lambda: generating_worker(deployment_client, workers, ids), timeout=120)
            assert victim is not None, "\n".join(w.log() for w in workers)
            survivor = next(w for w in workers if w is not victim)
            victim.process.kill()
            victim.process.wait()
            results = [client.result(job_id, timeout=180) for job_id in ids]
        resumed = 0
        for job_id, result, want in zip(ids, results, fault_free):
            assert (result.status, result.token_ids, result.text) == ("done", want.token_ids, want.text), job_id
            assert_one_final_result(deployment_client, job_id)
            assert tokens_published(deployment_client, job_id) == result.token_ids  # each token once, none missing
            resumed += len(runs(deployment_client, job_id)) > 1
        assert resumed > 0
        assert counter(survivor, "mili_speculative_accepted_tokens") > 0  # it did verify drafts
    finally:
        for worker in workers:
            worker.stop()
