"""Redis's real failure modes, each with jobs running on two worker processes (the echo engine)
and a producer submitting all along: a restart with AOF (appendfsync everysec, as the compose
file runs it), a restart with no persistence, memory full (maxmemory reached and released), the
server turned read-only and back, SCRIPT FLUSH, and every client connection killed. The workers
ride out each one without restarting, and every job whose submit returned ends exactly once with
its whole output, except, after the empty restart, jobs whose keys Redis itself lost: those are
not found, as docs/failure-semantics.md's table says."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.polling import eventually
from producer_client import JobNotFound
from tests.support.clients import make_client
from tests.support.jobs import assert_one_final_result, tokens_published
from tests.support.workers import FAST_RECLAIM, WorkerProcess, start_workers
from worker.embedded_redis import free_port


def restart_with_aof(server, admin):
    server.restart(down_s=1.0)


def restart_empty(server, admin):
    server.restart(down_s=1.0, keep_data=False)


def memory_full(server, admin):
    admin.config_set("maxmemory", 1)  # noeviction: every write refused
    time.sleep(1.0)
    admin.config_set("maxmemory", 0)


def read_only(server, admin):
    admin.replicaof("127.0.0.1", free_port())  # a replica of a master that never answers
    time.sleep(1.0)
    admin.replicaof("NO", "ONE")


def script_flush(server, admin):
    for _ in range(5):
        admin.script_flush()
        time.sleep(0.2)


def clients_killed(server, admin):
    for _ in range(5):
        admin.client_kill_filter(_type="normal", skipme=True)
        time.sleep(0.2)


FAULTS = [restart_with_aof, restart_empty, memory_full, read_only, script_flush, clients_killed]


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.__name__)
def test_workers_ride_out_the_fault_and_every_acknowledged_job_ends_once(
    fault,
    restartable_redis,
    redis_client_of,
    tmp_path,
):
    queue = f"fault-{uuid.uuid4().hex[:6]}"
    workers = start_workers(
        [
            WorkerProcess(restartable_redis.url, queue, f"{queue}-{n}", tmp_path, *FAST_RECLAIM, model="echo")
            for n in range(2)
        ]
    )
    pids = [w.heartbeat()["pid"] for w in workers]
    submitted: dict[str, str] = {}  # acknowledged submits: job id -> prompt
    refused = []
    stop = threading.Event()

    def produce() -> None:
        with make_client("sync", restartable_redis.url, queue) as client:
            n = 0
            while not stop.is_set():
                prompt = f"job {n} ".ljust(150, ".")
                try:
                    submitted[client.submit(prompt, max_tokens=150)] = prompt
                except Exception as e:  # not acknowledged: the producer knows it was not taken
                    refused.append(repr(e))
                n += 1
                time.sleep(0.02)

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        time.sleep(1.5)
        fault(restartable_redis, redis_client_of(restartable_redis))
        time.sleep(1.5)
        stop.set()
        producer.join()
        admin = redis_client_of(restartable_redis)
        lost = []
        with make_client("sync", restartable_redis.url, queue) as client:
            for job_id, prompt in submitted.items():
                try:
                    result = client.result(job_id, timeout=120)
                except JobNotFound:
                    lost.append(job_id)
                    continue
                assert (result.status, result.text) == ("done", prompt), job_id
                assert tokens_published(admin, job_id) == list(prompt.encode()), job_id
                assert_one_final_result(admin, job_id)
        if fault is restart_empty:
            assert len(lost) < len(submitted)
        else:
            assert lost == []
        assert [w.process.poll() for w in workers] == [None, None]
        assert [w.heartbeat()["pid"] for w in workers] == pids
        with make_client("sync", restartable_redis.url, queue) as client:
            assert client.generate("after", max_tokens=5, timeout=30).text == "after"
        print(
            f"\n{fault.__name__}: {len(submitted)} jobs acknowledged, {len(lost)} lost with Redis's data; "
            f"{len(refused)} submits refused: {refused[:2]}"
        )
    finally:
        stop.set()
        for w in workers:
            w.stop()


def test_a_workers_queue_depth_is_absent_while_redis_is_away_and_redis_up_says_so(restartable_redis, tmp_path):
    """The worker kept the last depth its heartbeat read while Redis was stopped: a stale backlog,
    which KEDA and alerts take for a live one. Now mili_worker_redis_up says 0 and mili_queue_depth
    is absent within a few heartbeats (0.1 s here), and both are back once Redis answers again,
    as the gateway's mili_gateway_redis_up and queue series are (gateway/metrics.py)."""
    queue = f"away-{uuid.uuid4().hex[:6]}"
    (worker,) = start_workers([WorkerProcess(restartable_redis.url, queue, f"{queue}-0", tmp_path, model="echo")])
    port = int(worker.heartbeat()["metrics_port"])
    try:
        assert eventually(lambda: scraped(port) == {"redis_up": 1.0, "depth": 0.0}, timeout=10, interval=0.1)
        restartable_redis.stop()
        assert eventually(lambda: scraped(port) == {"redis_up": 0.0}, timeout=10, interval=0.1), scraped(port)
        restartable_redis.start()
        assert eventually(lambda: scraped(port) == {"redis_up": 1.0, "depth": 0.0}, timeout=20, interval=0.1)
        assert worker.process.poll() is None
    finally:
        worker.stop()


def scraped(port: int) -> dict[str, float]:
    """The worker's mili_worker_redis_up and mili_queue_depth, by short names (a name absent, absent)."""
    names = {"mili_worker_redis_up": "redis_up", "mili_queue_depth": "depth"}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {
        names[sample.name]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names
    }
