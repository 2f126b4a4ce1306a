"""Poison jobs made for real, for the tests of dead-letter commands and of the board: whenever
every given job runs on the live worker (their hashes say running, under its name), that worker
is killed with SIGKILL and another started, until each job has been delivered more than
max_deliveries times; the last worker then moves them to the dead-letter stream. The jobs' code
path holds no switch that could crash a production worker."""

from __future__ import annotations

from pathlib import Path

from harness.polling import eventually
from producer_client.keys import Keys
from tests.support.workers import FAST_RECLAIM, WorkerProcess

KEYS = Keys()
MAX_DELIVERIES = 2
# Seconds of echo (the echo engine emits one byte per step), so that a worker is killed while it
# runs the job, and that a retried job is seen running before it ends by itself.
LONG_PROMPT = "x" * 16000
LONG_FLAGS = ("--max-model-len", "20000")


def echo_worker(redis_url: str, queue: str, name: str, log_dir: Path) -> WorkerProcess:
    return (
        WorkerProcess(
            redis_url,
            queue,
            name,
            log_dir,
            *FAST_RECLAIM,
            *LONG_FLAGS,
            "--max-deliveries",
            str(MAX_DELIVERIES),
            model="echo",
        )
        .start()
        .wait_ready()
    )


def kill_until_dead_lettered(
    redis_client, redis_url: str, queue: str, job_ids: list[str], log_dir: Path
) -> list[WorkerProcess]:
    """Returns every worker started, the survivor (which dead-lettered the jobs) last; the caller
    stops them."""
    workers = [echo_worker(redis_url, queue, f"{queue}-0", log_dir)]
    try:
        for _ in range(MAX_DELIVERIES):
            live = workers[-1]
            taken = eventually(lambda: not live.running or _all_running_on(redis_client, job_ids, live.name), 120)  # noqa: B023
            assert taken and live.running, live.log()
            live.kill()
            workers.append(echo_worker(redis_url, queue, f"{queue}-{len(workers)}", log_dir))
        assert eventually(lambda: redis_client.xlen(KEYS.dead(queue)) == len(job_ids), timeout=60), workers[-1].log()
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers


def _all_running_on(redis_client, job_ids: list[str], worker: str) -> bool:
    return all(_running_on(redis_client, job_id, worker) for job_id in job_ids)


def _running_on(redis_client, job_id: str, worker: str) -> bool:
    job = redis_client.hgetall(KEYS.job(job_id))
    assert job.get("status") in ("queued", "running"), job
    return job.get("status") == "running" and job.get("worker") == worker
