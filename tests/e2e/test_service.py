"""The whole service: real redis-server, real worker processes on the tiny preset, the real
clients. The paths a user's job takes (submit and result, streaming, cancel) run on each of
Redis's modes (one server, a cluster, Sentinel's), the rest on one server. Jobs are short (a few
greedy tokens) so that the suite stays quick on a CPU."""

from __future__ import annotations

import threading
import time
import urllib.request
import uuid
from contextlib import contextmanager

import pytest
import torch

from harness.polling import eventually
from producer_client import JobFailed, SamplingParams
from producer_client.connection import connect
from producer_client.keys import GROUP, PROTOCOL_VERSION, Keys
from tests.e2e.support import E2E_QUEUE, MAX_MODEL_LEN, MAX_RUNNING
from tests.support.clients import make_client
from tests.support.fixtures import SERVER_ONLY
from tests.support.jobs import assert_one_final_result, entries_added, queue_streams, runs
from tests.support.workers import WorkerProcess, start_workers

KEYS = Keys()
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Redis", "Once upon a time, in a land far away, there"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
METRIC_NAMES = [
    "mili_num_requests_running",
    "mili_num_requests_waiting",
    "mili_queue_depth",
    "mili_kv_cache_usage_perc",
    "mili_time_to_first_token_seconds",
    "mili_time_per_output_token_seconds",
    "mili_e2e_request_latency_seconds",
    "mili_request_queue_time_seconds",
    "mili_prompt_tokens_total",
    "mili_generation_tokens_total",
    "mili_prefix_cache_queries_total",
    "mili_prefix_cache_hits_total",
    "mili_num_preemptions_total",
    "mili_jobs_total",
    "mili_grammar_cache_hits_total",
    "mili_grammar_compiles_total",
    "mili_grammar_compile_seconds_total",
]


@pytest.fixture(scope="module")
def offline_engine():
    from worker.engine.engine import Engine

    return Engine.from_pretrained("tiny", max_model_len=MAX_MODEL_LEN, max_running=MAX_RUNNING, kv_cache_mib=64)


@contextmanager
def torch_threads(n: int):
    """As in the workers (see WorkerProcess), for speed on a shared machine; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def client(client_kind, redis_deployment, e2e_workers):
    c = make_client(client_kind, redis_deployment.url, E2E_QUEUE)
    yield c
    c.close()


def test_queue_path_gives_the_offline_engines_greedy_output(client, offline_engine):
    tokenizer = offline_engine.tokenizer
    chat_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    with torch_threads(1):
        expected = offline_engine.generate(
            [tokenizer.encode(p) for p in PROMPTS] + [chat_ids, [9707, 11, 1879]],
            SamplingParams(max_tokens=8, temperature=0.0),
        )
    ids = [client.submit(p, max_tokens=8, temperature=0.0) for p in PROMPTS]
    ids.append(client.submit(messages=CHAT, max_tokens=8, temperature=0.0))
    ids.append(client.submit(input_ids=[9707, 11, 1879], max_tokens=8, temperature=0.0))
    for job_id, want in zip(ids, expected):
        got = client.result(job_id, timeout=120)
        assert got.status == "done"
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
        assert got.usage.completion_tokens == 8


def test_streamed_deltas_concatenate_and_a_resumed_stream_loses_nothing(client):
    job_id = client.submit("Streaming test:", max_tokens=12, temperature=0.0)
    head = []
    for delta in client.stream(job_id, timeout=120):
        head.append(delta)
        if len(head) == 4:
            break  # the consumer disconnects
    tail = list(client.stream(job_id, after=head[-1].event_id, timeout=120))
    whole = list(client.stream(job_id, timeout=120))
    result = client.result(job_id, timeout=120)
    assert head + tail == whole
    assert "".join(d.text for d in whole) == result.text
    assert [t for d in whole for t in d.token_ids] == result.token_ids
    assert len(result.token_ids) == 12


@SERVER_ONLY
def test_two_workers_share_twenty_jobs(redis_deployment, e2e_workers):
    with make_client("sync", redis_deployment.url, E2E_QUEUE) as c:
        ids = [c.submit(f"job {i}", max_tokens=4, temperature=0.0) for i in range(20)]
        results = [c.result(job_id, timeout=120) for job_id in ids]
    assert all(r.status == "done" and len(r.token_ids) == 4 for r in results)
    ran = {w.name: sum(r.worker == w.name for r in results) for w in e2e_workers}
    assert all(n > 0 for n in ran.values()), ran
    assert sum(ran.values()) == 20


@SERVER_ONLY
def test_a_worker_never_holds_more_pending_entries_than_max_running(redis_deployment, deployment_client, e2e_workers):
    streams = queue_streams(deployment_client, E2E_QUEUE)  # the shared one and, with placement, each worker's own
    most: dict[str, int] = {}
    done = threading.Event()

    def sample() -> None:
        r = connect(redis_deployment.url, decode_responses=True)
        while not done.is_set():
            # One transaction: the streams' pending entries at one moment, so none counts twice.
            pipe = r.pipeline(transaction=True)
            for stream in streams:
                pipe.xpending_range(stream, GROUP, "-", "+", 100)
            held: dict[str, int] = {}
            for rows in pipe.execute(raise_on_error=False):
                for row in [] if isinstance(rows, Exception) else rows:  # a stream nobody read yet
                    held[row["consumer"]] = held.get(row["consumer"], 0) + 1
            for name, count in held.items():
                most[name] = max(most.get(name, 0), count)
        r.close()

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        with make_client("sync", redis_deployment.url, E2E_QUEUE) as c:
            ids = [c.submit(f"pending {i}", max_tokens=6, temperature=0.0) for i in range(16)]
            assert all(c.result(job_id, timeout=120).status == "done" for job_id in ids)
    finally:
        done.set()
        sampler.join()
    assert most and max(most.values()) == MAX_RUNNING, most
    assert eventually(
        lambda: all(deployment_client.xlen(s) == 0 for s in streams)
    )  # the last ack follows the last result


def idle_free_pages(worker: WorkerProcess) -> int:
    """Free KV pages in a heartbeat written after this call, by the worker with no job running."""
    since = time.time()
    heartbeat: dict[str, str] = {}

    def idle() -> bool:
        heartbeat.update(worker.heartbeat())
        return float(heartbeat["updated_at"]) > since and heartbeat["running"] == "0"

    assert eventually(idle), heartbeat
    return int(heartbeat["free_pages"])


def test_cancel_mid_generation_ends_the_job_and_returns_its_pages(client, e2e_workers):
    free_before = {w.name: idle_free_pages(w) for w in e2e_workers}
    job_id = client.submit("Cancel me:", max_tokens=200, temperature=0.0, ignore_eos=True)
    next(iter(client.stream(job_id, timeout=120)))
    assert client.cancel(job_id).cancel_requested
    result = client.result(job_id, timeout=120)
    assert (result.status, result.finish_reason) == ("cancelled", "abort")
    assert 1 <= result.usage.completion_tokens < 200
    assert len(result.token_ids) == result.usage.completion_tokens
    worker = next(w for w in e2e_workers if w.name == result.worker)
    assert idle_free_pages(worker) == free_before[worker.name]


@SERVER_ONLY
def test_the_same_request_id_twice_runs_one_job(client, deployment_client):
    added_before = entries_added(deployment_client, E2E_QUEUE)
    request_id = f"once-{uuid.uuid4().hex}"
    assert client.submit("Once", max_tokens=3, request_id=request_id) == request_id
    assert client.submit("Once", max_tokens=3, request_id=request_id) == request_id
    assert client.result(request_id, timeout=120).status == "done"
    assert entries_added(deployment_client, E2E_QUEUE) == added_before + 1
    # One run, one end: read from its events, or (protocol v2 keeps them only for a job streamed or
    # resumed) from its result, as tests/support/jobs.py reads them.
    assert len(runs(deployment_client, request_id)) == 1
    assert_one_final_result(deployment_client, request_id)


@SERVER_ONLY
def test_bad_inputs_fail_with_a_code_and_the_workers_keep_serving(client, deployment_client):
    stream = KEYS.queue(E2E_QUEUE)
    tag = uuid.uuid4().hex[:8]
    bad = {
        f"long-{tag}": (f'{{"input_ids": [{",".join(["100"] * MAX_MODEL_LEN)}]}}', "prompt_too_long"),
        f"stop-{tag}": ('{"prompt": "a", "params": {"stop_token_ids": [999999999]}}', "invalid_argument"),
        f"vocab-{tag}": ('{"input_ids": [151936]}', "invalid_argument"),
        f"json-{tag}": ('{"prompt": ', "invalid_body"),
    }
    for job_id, (body, _) in bad.items():
        deployment_client.xadd(stream, {"id": job_id, "v": str(PROTOCOL_VERSION), "body": body})
    # A raw XADD creates no job hash (Client.submit does): the job exists once a worker reads it.
    assert eventually(lambda: all(deployment_client.exists(KEYS.job(job_id)) for job_id in bad), timeout=120)
    for job_id, (_, code) in bad.items():
        with pytest.raises(JobFailed) as e:
            client.result(job_id, timeout=120)
        assert e.value.code == code, job_id
    assert client.generate("Still serving", max_tokens=2, timeout=120).status == "done"


@SERVER_ONLY
def test_each_worker_exports_the_vllm_metric_vocabulary(e2e_workers):
    for w in e2e_workers:
        port = int(w.heartbeat()["metrics_port"])
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        missing = [name for name in METRIC_NAMES if f"\n{name}" not in text]
        assert not missing, (w.name, missing)
        assert 'mili_jobs_total{outcome="dead_lettered"} 0.0' in text


@SERVER_ONLY
def test_sigterm_drains_running_jobs_and_leaves_unread_ones_queued(redis_deployment, tmp_path):
    queue = f"drain-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(redis_deployment.url, queue, f"{queue}-w", tmp_path, "--max-running", "1")
    start_workers([worker])
    try:
        with make_client("sync", redis_deployment.url, queue) as c:
            running = c.submit("Drain me:", max_tokens=24, temperature=0.0, ignore_eos=True)
            waiting = c.submit("I wait", max_tokens=4)
            next(iter(c.stream(running, timeout=120)))
            assert worker.terminate(timeout=60) == 0
            result = c.result(running, timeout=1)
            assert (result.status, len(result.token_ids)) == ("done", 24)
            assert c.status(waiting).status == "queued"
            stats = c.queue_stats()
            assert (stats.depth, stats.pending, stats.waiting, stats.workers) == (1, 0, 1, [])
    finally:
        worker.stop()
