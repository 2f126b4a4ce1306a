"""The `mili` CLI against the shared workers (its whole round on each of Redis's modes, the rest on
one server), and the demo behind the README's run command."""

import json
import subprocess
import sys

from harness.processes import REPO
from tests.e2e.support import E2E_QUEUE
from tests.support.fixtures import SERVER_ONLY


def mili(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", "--redis", redis_url, "--queue", E2E_QUEUE, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_submit_status_result_cancel_and_stats(redis_deployment, e2e_workers):
    url = redis_deployment.url
    submitted = mili(url, "submit", "Hello from the CLI", "--max-tokens", "5", "--temperature", "0")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    result = json.loads(mili(url, "result", job_id, "--timeout", "60").stdout)
    assert (result["id"], result["status"], len(result["token_ids"])) == (job_id, "done", 5)
    status = json.loads(mili(url, "status", job_id).stdout)
    assert (status["status"], status["tokens"]) == ("done", 5)
    cancelled = json.loads(mili(url, "cancel", job_id).stdout)
    assert cancelled["status"] == "done"  # too late to cancel: nothing changes
    stats = json.loads(mili(url, "stats").stdout)
    assert stats["queue"] == E2E_QUEUE and sorted(stats["workers"]) == sorted(w.name for w in e2e_workers)


@SERVER_ONLY
def test_submit_stream_prints_the_text_as_it_comes(redis_deployment, e2e_workers):
    streamed = mili(redis_deployment.url, "submit", "Stream it", "--max-tokens", "6", "--temperature", "0", "--stream")
    assert streamed.returncode == 0, streamed.stderr
    assert "done (length), 6 tokens" in streamed.stderr
    job_id = streamed.stderr.split()[1]
    result = json.loads(mili(redis_deployment.url, "result", job_id).stdout)
    assert streamed.stdout == result["text"] + "\n"


@SERVER_ONLY
def test_errors_are_one_line_with_their_code(redis_deployment):
    missing = mili(redis_deployment.url, "status", "no-such-job")
    assert (missing.returncode, missing.stderr.strip()) == (
        1,
        "error: not_found: job 'no-such-job' not found (never submitted, or its result expired)",
    )
    bad = mili(redis_deployment.url, "submit", "x", "--max-tokens", "0")
    assert bad.returncode == 1 and bad.stderr.startswith("error: invalid_argument: max_tokens:")


def test_the_demo_runs_jobs_through_redis_and_a_worker_and_stops_cleanly():
    # The echo engine keeps this quick; the README's command runs the same code on `tiny`.
    demo = subprocess.run(
        [sys.executable, "-m", "worker", "demo", "--model", "echo"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    out = demo.stdout
    assert "[" in out and "Once upon a time" in out
    assert "resubmitting request_id demo-0 returned the same job: True" in out
    assert 'chat.completions.create(model="echo"' in out
    assert "'user: Name a prime numbe' (length, 62 tokens)" in out  # the echo worker's 24 tokens, through the gateway
    assert "adapter demo-sql ->" in out and "adapter demo-chat ->" in out  # LoRA adapters, served by name
    assert "jobs: done 9, failed 0, cancelled 0, expired 0" in out
    # The worker's start is shown as it happens (its log's lines, before the first job), not after the demo.
    started, first_job = out.index("worker.loop.service: serving queue 'default'"), out.index("== one job")
    assert started < first_job, out
    assert "worker and redis-server stopped." in out
