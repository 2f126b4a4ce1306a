"""`mili dead`, `mili jobs` and `mili workers` against real workers: two poison jobs made by killing
the workers that run them are listed and shown; one is retried and runs to `done` as a new entry
with a fresh delivery count, its result and stream those of the new run alone; the other is purged."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid

import pytest

from harness.polling import eventually
from producer_client.keys import GROUP, Keys
from tests.support.clients import make_client
from tests.support.poison import LONG_PROMPT, MAX_DELIVERIES, kill_until_dead_lettered

KEYS = Keys()


def mili(redis_url: str, queue: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", "--redis", redis_url, "--queue", queue, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def rows(out: subprocess.CompletedProcess) -> list[list[str]]:
    """A table's rows (after its header), split on runs of two or more spaces."""
    assert out.returncode == 0, out.stderr
    return [re.split(r" {2,}", line.strip()) for line in out.stdout.splitlines()[1:]]


@pytest.mark.slow
def test_poison_jobs_are_listed_retried_to_done_and_purged_from_the_cli(redis_server, redis_client, tmp_path):
    url = redis_server.url
    queue = f"dead-cli-{uuid.uuid4().hex[:6]}"
    with make_client("sync", url, queue) as client:
        jobs = [client.submit(LONG_PROMPT, max_tokens=len(LONG_PROMPT)) for _ in range(2)]
        workers = kill_until_dead_lettered(redis_client, url, queue, jobs, tmp_path)
        survivor = workers[-1]
        try:
            listed = rows(mili(url, queue, "dead", "list"))
            assert sorted(r[1] for r in listed) == sorted(jobs)
            assert {(r[2], r[3]) for r in listed} == {(str(MAX_DELIVERIES + 1), survivor.name)}
            assert rows(mili(url, queue, "jobs", "--status", "dead")) == listed

            shown = json.loads(mili(url, queue, "dead", "show", jobs[0]).stdout)
            assert (shown["job_id"], shown["deliveries"], shown["worker"]) == (
                jobs[0],
                MAX_DELIVERIES + 1,
                survivor.name,
            )
            assert "more than max_deliveries 2" in shown["reason"]
            assert json.loads(shown["fields"]["body"])["prompt"] == LONG_PROMPT
            assert client.status(jobs[0]).result.error.code == "poison"

            retried = rows(mili(url, queue, "dead", "retry", shown["letter_id"]))
            assert [(r[0], r[1], r[2]) for r in retried] == [(shown["letter_id"], jobs[0], "retried")]
            new_entry = retried[0][3]
            assert eventually(lambda: client.status(jobs[0]).status == "running", timeout=30)
            running = rows(mili(url, queue, "jobs", "--status", "running"))
            assert [(r[0], r[1], r[2], r[3]) for r in running] == [(jobs[0], new_entry, survivor.name, "1")]

            result = client.result(jobs[0], timeout=120)
            assert (result.status, result.text, result.worker) == ("done", LONG_PROMPT, survivor.name)
            assert "".join(d.text for d in client.stream(jobs[0], timeout=10)) == LONG_PROMPT  # the new run's alone
            assert eventually(lambda: redis_client.xpending(KEYS.queue(queue), GROUP)["pending"] == 0)

            again = mili(url, queue, "dead", "retry", jobs[0])
            assert (again.returncode, again.stderr.count("\n")) == (1, 1)
            assert again.stderr.startswith(f"error: not_found: queue {queue!r} has no dead letter {jobs[0]!r}")

            purged = mili(url, queue, "dead", "purge", jobs[1])
            assert purged.returncode == 0 and purged.stdout.strip().endswith(f"of job {jobs[1]}")
            assert rows(mili(url, queue, "dead", "list")) == []
            assert client.status(jobs[1]).status == "failed"  # the job's own record stays until it expires

            live = rows(mili(url, queue, "workers"))
            assert [r[:5] for r in live if r[1] == queue] == [[survivor.name, queue, "echo", "cpu", "serving"]]
        finally:
            for w in workers:
                w.stop()
