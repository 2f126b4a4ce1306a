"""The operator's `mili` commands in process, on a real redis-server: what they print, and that every
bad input is one line on stderr with a non-zero exit that changes nothing."""

from __future__ import annotations

import pytest

from cli.__main__ import main
from producer_client import Client
from producer_client.keys import Keys
from tests.queue.test_dead_letters import make_poison, take

KEYS = Keys()


@pytest.fixture
def mili(redis_server, queue, capsys):
    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main(["--redis", redis_server.url, "--queue", queue, *args])
        except SystemExit as e:  # a usage error, from argparse
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_jobs_lists_the_queued_and_running_jobs(mili, redis_server, redis_client, queue):
    with Client(redis_server.url, queue) as client:
        jobs = [client.submit(f"job {i}", max_tokens=4) for i in range(3)]
    entry, _ = take(redis_client, queue, "w1")
    code, out, _ = mili("jobs", "--status", "queued")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["JOB", jobs[1], jobs[2]]
    code, out, _ = mili("jobs", "--status", "running", "--limit", "5")
    assert code == 0 and out.splitlines()[1].split()[:4] == [jobs[0], entry, "w1", "1"]


def test_dead_purge_older_than_takes_a_duration(mili, redis_server, redis_client, queue):
    with Client(redis_server.url, queue) as client:
        make_poison(redis_client, queue, client.submit("poison", max_tokens=4))
    assert mili("dead", "purge", "--older-than", "1h")[:2] == (0, "purged 0 dead letters\n")
    assert redis_client.xlen(KEYS.dead(queue)) == 1
    assert mili("dead", "purge", "--all")[:2] == (0, "purged 1 dead letters\n")


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ("jobs", "--status", "failed"),
            1,
            "error: invalid_argument: status: failed jobs cannot be listed: ended jobs have no index",
        ),
        (("jobs", "--status", "sleeping"), 1, "error: invalid_argument: status: must be one of queued, running, dead"),
        (("jobs",), 2, "error: invalid_argument: the following arguments are required: --status"),
        (
            ("jobs", "--status", "queued", "--limit", "0"),
            1,
            "error: invalid_argument: limit: must be an integer from 1 to 10000",
        ),
        (
            ("dead", "list", "--limit", "many"),
            2,
            "error: invalid_argument: argument --limit: invalid int value: 'many'",
        ),
        (("dead", "retry"), 1, "error: invalid_argument: id: give exactly one of ID or --all"),
        (("dead", "retry", "x", "--all"), 1, "error: invalid_argument: id: give exactly one of ID or --all"),
        (
            ("dead", "purge", "--all", "--older-than", "1d"),
            1,
            "error: invalid_argument: id: give exactly one of ID or --all or --older-than",
        ),
        (("dead", "purge", "--older-than", "soon"), 1, "error: invalid_argument: older_than: 'soon' is not a duration"),
        (("dead", "purge", "--older-than", "0s"), 1, "error: invalid_argument: older_than: '0s' is not a duration"),
        (("dead", "show", "no-such-job"), 1, "error: not_found: queue"),
        (("dead", "retry", "{bad}"), 1, "error: invalid_argument: id: must be 1-128 characters"),
        (("dead", "frobnicate"), 2, "error: invalid_argument: argument dead_command: invalid choice: 'frobnicate'"),
    ],
)
def test_a_bad_input_is_one_line_and_changes_nothing(mili, redis_server, redis_client, queue, args, code, message):
    with Client(redis_server.url, queue) as client:
        make_poison(redis_client, queue, client.submit("poison", max_tokens=4))
    got_code, _, err = mili(*args)
    assert got_code == code
    assert err.count("\n") == 1 and err.startswith(message), err
    assert redis_client.xlen(KEYS.dead(queue)) == 1
