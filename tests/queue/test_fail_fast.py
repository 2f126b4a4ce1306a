"""Probes fail fast where a client's calls retry for seconds: a dead port, a silent server or an
unknown host is an answer with its cause within the probe's bound, in every Redis mode; the
`mili` CLI says so in one line. A client's own calls keep their retries (tests/queue/test_redis_faults.py,
tests/chaos/test_failover.py)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import redis

from cli.__main__ import main
from producer_client.connection import PROBE_TIMEOUT_S, Unreachable, probe
from producer_client.protocol.execution import execute
from worker.embedded_redis import free_port

# A refused connection is known in milliseconds; this much is left for a loaded machine.
REFUSED_BOUND_S = PROBE_TIMEOUT_S
SILENT_TIMEOUT_S = 0.3


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that takes connections (the kernel's backlog) and never answers: a hung Redis."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield listener.getsockname()[1]


def timed_probe(url: str, timeout_s: float) -> tuple[float, str]:
    started = time.monotonic()
    with pytest.raises(Unreachable) as caught:
        probe(url, timeout_s)
    return time.monotonic() - started, str(caught.value)


def refused(port: int) -> str:
    return f"ConnectionError: Error 111 connecting to 127.0.0.1:{port}. Connection refused."


@pytest.mark.timing
def test_a_probe_of_a_dead_port_says_why_at_once():
    a, b = free_port(), free_port()
    for url, expected in (
        (f"redis://127.0.0.1:{a}/0", refused(a)),
        (f"redis+cluster://127.0.0.1:{a},127.0.0.1:{b}", (refused(a), refused(b))),
        # each sentinel asked once, named by its address, with its cause
        (
            f"redis+sentinel://127.0.0.1:{a},127.0.0.1:{b}/mymaster",
            f"MasterNotFoundError: No master found for 'mymaster' : <sentinel 127.0.0.1:{a}> - {refused(a)}, "
            f"<sentinel 127.0.0.1:{b}> - {refused(b)}",
        ),
    ):
        elapsed, message = timed_probe(url, PROBE_TIMEOUT_S)
        assert elapsed < REFUSED_BOUND_S
        assert message in (expected if isinstance(expected, tuple) else (expected,)), message


def test_a_probes_check_through_the_clients_boundary_says_redis_pys_cause():
    """A check whose calls go through protocol.execution (the healthcheck's read of the live
    workers) meets the client's RedisUnavailable: the probe says its cause, as for a PING's."""
    port = free_port()
    with pytest.raises(Unreachable) as caught:
        probe(
            f"redis://127.0.0.1:{port}/0", PROBE_TIMEOUT_S, lambda client: execute(client, lambda pipe: pipe.echo("x"))
        )
    assert str(caught.value) == refused(port)


def test_a_probe_of_an_unknown_host_says_so():
    _, message = timed_probe("redis://no-such-host.invalid:6379/0", PROBE_TIMEOUT_S)
    assert message.startswith("ConnectionError: Error ") and "no-such-host.invalid:6379" in message


@pytest.mark.timing
@pytest.mark.parametrize("mode", ["redis://{a}/0", "redis+cluster://{a},{a}", "redis+sentinel://{a},{a},{a}/mymaster"])
def test_probes_of_a_silent_redis_give_up_at_their_bound(silent_port, mode):
    """Several probes at once, each past its bound: in sentinel mode three silent sentinels one
    after the other would take three socket timeouts, the probe still one."""
    url = mode.format(a=f"127.0.0.1:{silent_port}")
    outcomes: list[tuple[float, str]] = []
    probes = [threading.Thread(target=lambda: outcomes.append(timed_probe(url, SILENT_TIMEOUT_S))) for _ in range(4)]
    for thread in probes:
        thread.start()
    for thread in probes:
        thread.join()
    assert len(outcomes) == 4
    for elapsed, message in outcomes:
        assert SILENT_TIMEOUT_S <= elapsed < SILENT_TIMEOUT_S + 1.0
        assert message in ("no answer within 0.3 s", "TimeoutError: Timeout reading from socket"), message


def test_a_probe_of_a_live_redis_gives_its_checks_answer(redis_server):
    assert probe(redis_server.url, PROBE_TIMEOUT_S) is True
    assert probe(redis_server.url, PROBE_TIMEOUT_S, lambda client: client.echo("here")) == "here"


def test_a_refusal_that_no_retry_mends_is_raised_as_itself(redis_server):
    with pytest.raises(redis.ResponseError, match="unknown command"):
        probe(redis_server.url, PROBE_TIMEOUT_S, lambda client: client.execute_command("NO-SUCH-COMMAND"))


def mili(*args: str, capsys) -> tuple[int, str, float]:
    started = time.monotonic()
    code = main(list(args))
    return code, capsys.readouterr().err, time.monotonic() - started


@pytest.mark.timing
def test_a_cli_command_against_a_dead_port_fails_at_once_with_the_cause(capsys):
    port = free_port()
    code, err, elapsed = mili("--redis", f"redis://127.0.0.1:{port}/0", "stats", capsys=capsys)
    cause = f"ConnectionError: Error 111 connecting to 127.0.0.1:{port}. Connection refused."
    assert (code, err) == (1, f"error: redis_unavailable: Redis at 127.0.0.1:{port} is unavailable: {cause}\n")
    assert elapsed < REFUSED_BOUND_S


@pytest.mark.timing
def test_a_cli_command_waits_for_a_silent_redis_no_longer_than_its_connect_timeout(silent_port, capsys):
    url = f"redis://127.0.0.1:{silent_port}/0"
    code, err, elapsed = mili("--redis", url, "--connect-timeout", "0.3", "status", "some-job", capsys=capsys)
    assert code == 1 and err.startswith(f"error: redis_unavailable: Redis at 127.0.0.1:{silent_port} is unavailable: ")
    assert err.endswith(("no answer within 0.3 s\n", "TimeoutError: Timeout reading from socket\n"))
    assert SILENT_TIMEOUT_S <= elapsed < SILENT_TIMEOUT_S + 1.0


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf"])
def test_a_connect_timeout_that_is_no_positive_number_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--connect-timeout", value, "stats"])
    assert exited.value.code == 2
    assert capsys.readouterr().err == (
        f"error: invalid_argument: argument --connect-timeout: {value!r} is not a positive number of seconds "
        "(see mili --help)\n"
    )
