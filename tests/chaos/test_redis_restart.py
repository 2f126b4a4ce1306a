"""Redis restarted mid-run, with AOF on (appendfsync everysec, as the compose file runs it): every
job whose submit returned completes, exactly once and with its whole output, and the workers ride
out the outage without restarting."""
from __future__ import annotations

import threading
import time
import uuid

import pytest

from producer_client.keys import Keys
from tests.chaos.conftest import FAST_RECLAIM
from tests.redis_support import (
    WorkerProcess, assert_one_final_result, make_client, start_workers, tokens_published,
)

KEYS = Keys()


@pytest.mark.slow
def test_a_redis_restart_loses_no_acknowledged_job(restartable_redis, redis_client_of, tmp_path):
    queue = f"restart-{uuid.uuid4().hex[:6]}"
    workers = start_workers([
        WorkerProcess(restartable_redis.url, queue, f"{queue}-{n}", tmp_path, *FAST_RECLAIM, model="echo")
        for n in range(2)
    ])
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
        restartable_redis.restart(down_s=1.0)
        time.sleep(1.5)
        stop.set()
        producer.join()
        with make_client("sync", restartable_redis.url, queue) as client:
            results = {job_id: client.result(job_id, timeout=120) for job_id in submitted}
        client_redis = redis_client_of(restartable_redis)
        for job_id, prompt in submitted.items():
            assert (results[job_id].status, results[job_id].text) == ("done", prompt), job_id
            assert tokens_published(client_redis, job_id) == list(prompt.encode()), job_id
            assert_one_final_result(client_redis, job_id)
        assert [w.process.poll() for w in workers] == [None, None]
        assert [w.heartbeat()["pid"] for w in workers] == pids
        print(f"\nredis restart: {len(submitted)} jobs acknowledged, all done; {len(refused)} submits refused: {refused[:3]}")
    finally:
        stop.set()
        for w in workers:
            w.stop()
