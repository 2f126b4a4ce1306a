"""Deadlines on a real worker process: a job whose deadline passes while it waits in the queue is
never started (`expired`, no start event, no token), and a running job that reaches its deadline
stops with finish_reason "timeout" and returns the output it has. On each of Redis's modes: on a
cluster, a job's deadline comes from its own shard's clock (CREATE) and its wait from the queue's
(the entry's id), which the worker compares on the clock it measures (RedisClock)."""

from __future__ import annotations

import uuid

import pytest

from harness.polling import eventually
from producer_client import JobExpired
from tests.support.clients import make_client
from tests.support.jobs import runs, tokens_published
from tests.support.workers import WorkerProcess, start_workers

pytestmark = pytest.mark.waits


@pytest.mark.slow
def test_expired_jobs_are_not_run_and_timed_out_jobs_return_partial_output(
    redis_deployment, deployment_client, tmp_path
):
    queue = f"deadline-{uuid.uuid4().hex[:6]}"
    (worker,) = start_workers(
        [
            WorkerProcess(
                redis_deployment.url,
                queue,
                f"{queue}-w",
                tmp_path,
                "--max-running",
                "1",
                "--max-model-len",
                "32768",
                model="echo",
            )
        ]
    )
    try:
        with make_client("sync", redis_deployment.url, queue) as client:
            # The only slot runs a job of 16,000 steps (a Redis round trip each: seconds) that
            # times out after 0.2 s; the job behind it waits in the queue past its own deadline.
            running = client.submit("r" * 16000, max_tokens=16000, timeout_s=0.2)
            waiting = client.submit("never", max_tokens=8, timeout_s=0.1)
            timed_out = client.result(running, timeout=30)
            with pytest.raises(JobExpired):
                client.result(waiting, timeout=30)
            assert eventually(lambda: client.status(waiting).result is not None, timeout=30)
            expired = client.status(waiting).result
        assert (timed_out.status, timed_out.finish_reason) == ("done", "timeout")
        assert 0 < timed_out.usage.completion_tokens < 16000
        assert timed_out.text == "r" * timed_out.usage.completion_tokens
        assert tokens_published(deployment_client, running) == timed_out.token_ids
        assert (expired.status, expired.finish_reason, expired.text, expired.token_ids) == ("expired", None, "", [])
        assert runs(deployment_client, waiting) == []  # never started
        assert expired.timings.finished_at - expired.timings.queued_at >= 0.1
    finally:
        worker.stop()
