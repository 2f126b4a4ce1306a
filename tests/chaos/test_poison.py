"""A job that crashes its worker every time ends in the dead-letter stream after max_deliveries.
The crash is done from outside, as a test must: whenever a worker starts the job (its hash says
running, under that worker's name), the test kills that worker with SIGKILL and starts another.
The job's code path holds no switch that could crash a production worker."""

from __future__ import annotations

import time
import uuid

import pytest

from harness.polling import eventually
from producer_client import JobFailed
from producer_client.keys import Keys
from tests.support.clients import make_client
from tests.support.jobs import queue_depth, queue_pending
from tests.support.workers import FAST_RECLAIM, WorkerProcess

pytestmark = pytest.mark.waits

KEYS = Keys()
MAX_DELIVERIES = 2


@pytest.mark.slow
def test_a_job_that_kills_every_worker_that_runs_it_is_dead_lettered(redis_server, redis_client, tmp_path):
    queue = f"poison-{uuid.uuid4().hex[:6]}"

    def worker(n: int) -> WorkerProcess:
        return (
            WorkerProcess(
                redis_server.url,
                queue,
                f"{queue}-{n}",
                tmp_path,
                *FAST_RECLAIM,
                "--max-deliveries",
                str(MAX_DELIVERIES),
                model="echo",
            )
            .start()
            .wait_ready()
        )

    workers = [worker(0)]
    try:
        with make_client("sync", redis_server.url, queue) as client:
            job_id = client.submit("x" * 4000, max_tokens=4000)  # seconds of echo: it never ends by itself
            killed = []
            while len(killed) < MAX_DELIVERIES:
                live = workers[-1]
                job = redis_client.hgetall(KEYS.job(job_id))
                if job.get("status") == "running" and job.get("worker") == live.name:
                    live.kill()
                    killed.append(live.name)
                    workers.append(worker(len(workers)))
                assert job.get("status") in ("queued", "running"), job
                time.sleep(0.01)
            with pytest.raises(JobFailed) as e:
                client.result(job_id, timeout=60)
            survivor = workers[-1]
            assert client.generate("next job", max_tokens=20, timeout=60).text == "next job"
        assert e.value.code == "poison"
        assert e.value.result.worker == survivor.name
        ((_, letter),) = redis_client.xrange(KEYS.dead(queue))
        assert (letter["id"], letter["deliveries"], letter["worker"]) == (
            job_id,
            str(MAX_DELIVERIES + 1),
            survivor.name,
        )
        assert letter["reason"] == e.value.message
        # The last job's entry is acknowledged just after its result is written.
        assert eventually(lambda: queue_depth(redis_client, queue) == 0)
        assert queue_pending(redis_client, queue) == 0
        assert redis_client.hget(KEYS.job(job_id), "status") == "failed"
        assert survivor.running
    finally:
        for w in workers:
            w.stop()
