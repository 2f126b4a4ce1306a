"""SIGTERM drains a worker: no job is lost. Its running jobs finish within drain_grace_s or are
handed over, and the other worker resumes them at once from their recorded tokens (no waiting
for claim_idle_ms, no token made twice, no delivery counted against max_deliveries)."""

from __future__ import annotations

import uuid

import pytest

from harness.polling import eventually
from producer_client.keys import Keys
from tests.support.clients import make_client
from tests.support.jobs import assert_one_final_result, queue_pending, runs, tokens_published
from tests.support.workers import WorkerProcess, start_workers

KEYS = Keys()


@pytest.mark.slow
def test_sigterm_hands_running_jobs_over_and_none_is_lost(redis_server, redis_client, tmp_path):
    queue = f"drain-{uuid.uuid4().hex[:6]}"
    # claim_idle_ms of a minute: a job that moved sooner was handed over, not reclaimed. A grace far
    # shorter than a job (3,000 echo steps take a few tenths of a second, unpaced by Redis since
    # publication left the loop's path): every running job is handed over.
    flags = ("--claim-idle-ms", "60000", "--reclaim-interval-s", "0.2", "--max-running", "4", "--drain-grace-s", "0.02")
    leaving, staying = start_workers(
        [WorkerProcess(redis_server.url, queue, f"{queue}-{n}", tmp_path, *flags, model="echo") for n in ("a", "b")]
    )
    try:
        with make_client("sync", redis_server.url, queue) as client:
            prompts = {client.submit(p, max_tokens=3000): p for p in (f"{i} ".ljust(3000, "~") for i in range(8))}
            assert eventually(
                lambda: sum(redis_client.hget(KEYS.job(j), "worker") == leaving.name for j in prompts) == 4, timeout=30
            )
            assert leaving.terminate(timeout=30) == 0
            results = {job_id: client.result(job_id, timeout=30) for job_id in prompts}  # < claim_idle_ms
        handed_over = 0
        for job_id, prompt in prompts.items():
            assert (results[job_id].status, results[job_id].text) == ("done", prompt)
            assert tokens_published(redis_client, job_id) == list(prompt.encode())
            assert_one_final_result(redis_client, job_id)
            job_runs = runs(redis_client, job_id)
            if job_runs[0][0]["worker"] == leaving.name:
                (first, made), (second, _) = job_runs
                assert (second["worker"], second["resumed_tokens"]) == (staying.name, len(made))
                handed_over += 1
        assert handed_over == 4
        assert redis_client.xlen(KEYS.dead(queue)) == 0
        assert eventually(lambda: queue_pending(redis_client, queue) == 0)
        assert "handed 4 unfinished jobs over" in leaving.log()
    finally:
        leaving.stop()
        staying.stop()
