"""`python -m worker healthcheck` against a real redis-server and real worker processes: 0 only
while this worker's heartbeat is live and Redis answers."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from harness.polling import eventually
from tests.deploy.support import HEARTBEAT_TTL_S, ROOT, environment_without_mili
from worker.__main__ import build_parser
from worker.embedded_redis import EmbeddedRedis, free_port
from worker.healthcheck import healthcheck
from worker.settings import WorkerSettings

# A heartbeat expires HEARTBEAT_TTL_S after the last beat; allow for a loaded machine.
EXPIRY_TIMEOUT_S = HEARTBEAT_TTL_S + 5.0


pytestmark = pytest.mark.usefixtures("no_mili_environment")


def check(url: str, name: str = "") -> int:
    return healthcheck(WorkerSettings(redis=url, name=name))


def test_healthy_while_the_named_worker_heartbeats(redis_server, start_worker, capsys):
    start_worker("hc-live")
    assert check(redis_server.url, "hc-live") == 0
    assert "healthy: worker hc-live has a live heartbeat" in capsys.readouterr().out


def test_an_unnamed_check_finds_the_worker_of_this_host(redis_server, start_worker, capsys):
    worker = start_worker()  # named <hostname>-<pid>, as in a container
    assert check(redis_server.url) == 0
    assert f"worker {worker.name} has a live heartbeat" in capsys.readouterr().out


def test_an_unnamed_check_ignores_workers_of_other_hosts(redis_server, start_worker, capsys):
    start_worker("otherhost-1")
    assert check(redis_server.url) == 1
    assert "no live heartbeat for worker" in capsys.readouterr().err


def test_unhealthy_for_a_name_with_no_worker(redis_server, start_worker):
    start_worker("hc-present")
    assert check(redis_server.url, "hc-absent") == 1


def test_unhealthy_once_the_worker_is_killed(redis_server, start_worker, capsys):
    worker = start_worker("hc-dead")
    assert check(redis_server.url, "hc-dead") == 0
    worker.kill()  # SIGKILL: no chance to remove its heartbeat, which must expire
    assert eventually(lambda: check(redis_server.url, "hc-dead") == 1, EXPIRY_TIMEOUT_S), (
        "the dead worker's heartbeat stays"
    )
    assert "unhealthy: no live heartbeat for worker hc-dead on queue default" in capsys.readouterr().err


def test_unhealthy_while_the_worker_is_frozen_and_healthy_again_after(redis_server, start_worker):
    worker = start_worker("hc-frozen")
    worker.process.send_signal(signal.SIGSTOP)  # a hung worker: alive, but its heartbeat goes stale
    assert eventually(lambda: check(redis_server.url, "hc-frozen") == 1, EXPIRY_TIMEOUT_S), "the stale heartbeat stays"
    worker.process.send_signal(signal.SIGCONT)
    assert eventually(lambda: check(redis_server.url, "hc-frozen") == 0, EXPIRY_TIMEOUT_S), "no fresh heartbeat"


def test_unhealthy_when_redis_is_down(redis_server, start_worker, capsys):
    start_worker("hc-orphan")
    url = redis_server.url
    assert check(url, "hc-orphan") == 0
    redis_server.stop()
    assert check(url, "hc-orphan") == 1
    assert "unhealthy: Redis does not answer: ConnectionError" in capsys.readouterr().err


def test_unhealthy_when_no_redis_ever_listened(capsys):
    server = EmbeddedRedis().start()
    url = server.url
    server.stop()
    assert check(url, "anyone") == 1
    assert "Redis does not answer" in capsys.readouterr().err


@pytest.mark.timing
def test_unhealthy_at_once_with_the_cause_when_redis_refuses(capsys):
    port = free_port()
    started = time.monotonic()
    assert check(f"redis://127.0.0.1:{port}/0", "anyone") == 1
    assert time.monotonic() - started < WorkerSettings().healthcheck_timeout_s
    assert capsys.readouterr().err == (
        f"unhealthy: Redis does not answer: ConnectionError: Error 111 connecting to 127.0.0.1:{port}. "
        "Connection refused.\n"
    )


@pytest.mark.timing
def test_unhealthy_within_its_timeout_while_redis_is_silent(capsys):
    """A hung Redis takes connections and answers nothing: the check ends at healthcheck_timeout_s,
    not at the probe's timeout, each time."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        settings = WorkerSettings(redis=f"redis://127.0.0.1:{silent.getsockname()[1]}/0", healthcheck_timeout_s=0.3)
        for _ in range(3):
            started = time.monotonic()
            assert healthcheck(settings) == 1
            assert 0.3 <= time.monotonic() - started < 1.3
            assert capsys.readouterr().err in (
                "unhealthy: Redis does not answer: no answer within 0.3 s\n",
                "unhealthy: Redis does not answer: TimeoutError: Timeout reading from socket\n",
            )


def test_an_embedded_redis_cannot_be_checked(capsys):
    assert check("embedded", "anyone") == 1
    assert "embedded Redis is private" in capsys.readouterr().err


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "worker", "healthcheck", *args],
        cwd=ROOT,
        env=environment_without_mili(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_exit_codes_for_a_live_and_a_dead_worker(redis_server, start_worker):
    worker = start_worker("hc-cli")
    live = run_cli("--redis", redis_server.url, "--name", "hc-cli")
    assert (live.returncode, live.stdout.strip()) == (0, "healthy: worker hc-cli has a live heartbeat")
    worker.kill()
    assert eventually(lambda: check(redis_server.url, "hc-cli") == 1, EXPIRY_TIMEOUT_S), (
        "the dead worker's heartbeat stays"
    )
    dead = run_cli("--redis", redis_server.url, "--name", "hc-cli")
    assert dead.returncode == 1
    assert "unhealthy: no live heartbeat for worker hc-cli" in dead.stderr


def test_cli_reads_the_same_environment_as_the_worker(redis_server, start_worker):
    """In a container the check gets no flags: MILI_* variables name the Redis and the worker."""
    start_worker("hc-env")
    env = {**environment_without_mili(), "MILI_REDIS": redis_server.url, "MILI_NAME": "hc-env"}
    result = subprocess.run(
        [sys.executable, "-m", "worker", "healthcheck"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("flags", [["--block-ms", "0"], ["--config", "/nonexistent/worker.toml"]])
def test_settings_that_do_not_load_are_unhealthy_with_exit_code_1(flags, capsys):
    """Not the CLI's usual 2 for errors: Docker reserves a HEALTHCHECK's exit code 2."""
    args = build_parser().parse_args(["healthcheck", *flags])
    assert args.run(args) == 1
    assert "unhealthy: the settings do not load" in capsys.readouterr().err


def test_the_healthcheck_command_does_not_import_torch():
    # Docker and Kubernetes run it every few seconds; torch alone costs seconds of CPU.
    code = "import sys, worker.__main__, worker.healthcheck; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
