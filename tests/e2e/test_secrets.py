"""No program prints a password, for any Redis URL a user can type: the `mili` CLI, the worker, its
healthcheck and its /metrics, the gateway's log and its /health, /metrics, /board and API answers.
Passwords are generated (hypothesis) with the characters that break naive redaction (`/`, `@`,
`#`, `:`, `%`, `?`, `&`), put raw or percent-encoded into each URL form: a Redis user with that
password exists, so an encoded URL logs in and the programs run; a raw one may not parse, or
may log in as another user, or reach no server, and is refused or retried. Every output of every
program is read, at DEBUG, and holds neither the password nor its encoding."""

from __future__ import annotations

import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from harness.polling import eventually
from harness.processes import ChildProcess
from producer_client.keys import Keys
from worker.embedded_redis import EmbeddedRedis, free_port

pytestmark = pytest.mark.waits

PASSWORD_CHARS = "abcXYZ0189/@#:%?&=+!$~*;,"
# The prefix keeps a short password from matching other text ("6379", "redis") by chance.
passwords = st.text(PASSWORD_CHARS, min_size=3, max_size=16).map(lambda rest: "Zq" + rest)
USER = "secret-user"
FORMS = [
    "redis://{user}:{password}@127.0.0.1:{port}/0",
    "redis://:{password}@127.0.0.1:{port}/0",
    "redis://{password}@127.0.0.1:{port}/0",
    "redis://127.0.0.1:{port}/0?socket_timeout=5&password={password}",
    "redis+sentinel://{user}:{password}@127.0.0.1:{dead},127.0.0.1:{dead}/mymaster",
    "redis+cluster://{user}:{password}@127.0.0.1:{dead}",
]
QUEUE = "secrets"
RUN_S = 3.0  # how long every program runs, once the gateway is up, before they are stopped


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis(port=free_port()) as redis_server:
        yield redis_server


def start(log_dir: Path, *args: str) -> ChildProcess:
    process = ChildProcess([sys.executable, "-m", *args], log_dir / f"{args[0]}-{args[1]}.log")
    process.stop_timeout_s = 30.0  # what a program says as it stops counts too
    return process.start()


def answers(port: int) -> bool:
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1)
        return True
    except OSError:
        return False


def fetch(url: str, data: bytes | None = None) -> str:
    headers = {"Content-Type": "application/json"} if data else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=3) as response:
            return response.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.read().decode(errors="replace")
    except OSError as e:  # no answer in time: a gateway whose Redis is not there retries longer
        return str(e)


def gateway_answers(port: int) -> list[str]:
    base = f"http://127.0.0.1:{port}"
    completion = b'{"model": "echo", "prompt": "hi", "max_tokens": 4}'
    requests = [
        (f"{base}/health", None),
        (f"{base}/metrics", None),
        (f"{base}/board", None),
        (f"{base}/v1/models", None),
        (f"{base}/v1/completions", completion),
    ]
    with ThreadPoolExecutor(len(requests)) as pool:  # at once: each may wait out its timeout
        return list(pool.map(lambda r: fetch(*r), requests))


def worker_metrics(server, name: str) -> str:
    import redis

    admin = redis.Redis.from_url(server.url, decode_responses=True)
    port = admin.hget(Keys().worker(name), "metrics_port")
    admin.close()
    return fetch(f"http://127.0.0.1:{port}/metrics") if port else ""


def stop(process: ChildProcess) -> str:
    process.stop()
    return process.log()


def outputs_of_every_program(server, url: str) -> list[str]:
    """Every program at once, each given RUN_S once up (a client whose Redis is not there retries
    for longer: what it said by then is read)."""
    name = f"secrets-{time.monotonic_ns()}"
    gateway_port = free_port()
    with tempfile.TemporaryDirectory(prefix="mili-secrets-") as logs:
        log_dir = Path(logs)
        gateway = start(
            log_dir,
            "gateway",
            "--redis",
            url,
            "--port",
            str(gateway_port),
            "--log-level",
            "DEBUG",
            "--default-queue",
            QUEUE,
            "--workers-refresh-s",
            "0.2",
        )
        worker = start(
            log_dir,
            "worker",
            "serve",
            "--model",
            "echo",
            "--redis",
            url,
            "--queue",
            QUEUE,
            "--name",
            name,
            "--metrics-host",
            "127.0.0.1",
            "--metrics-port",
            "0",
            "--log-level",
            "DEBUG",
            "--redis-backoff-max-s",
            "0.5",
        )
        cli = start(log_dir, "cli", "--redis", url, "--queue", QUEUE, "stats")
        check = start(log_dir, "worker", "healthcheck", "--redis", url, "--queue", QUEUE, "--name", name)
        said = []
        eventually(lambda: not gateway.running or answers(gateway_port), 60, interval=0.1)  # or it never answers
        time.sleep(RUN_S)  # the worker starts meanwhile, or retries an unreachable Redis
        if gateway.running:
            said += gateway_answers(gateway_port) + [worker_metrics(server, name)]
        return said + [stop(p) for p in (cli, check, worker, gateway)]


@pytest.mark.slow
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(password=passwords, form=st.sampled_from(FORMS), encoded=st.booleans())
@example(password="Zq/p@ss#w:rd%41", form=FORMS[0], encoded=True)  # logs in: every program runs
@example(password="Zq/p@ss#w:rd%41", form=FORMS[0], encoded=False)  # splits elsewhere: refused
@example(password="Zqp@ss:w", form=FORMS[2], encoded=False)  # user-only, reads as user:password
@example(password="Zqpa&ss=1", form=FORMS[3], encoded=False)  # a raw & in the query
@example(password="Zq:p@ss/w", form=FORMS[4], encoded=True)  # several sentinels, none there
@example(password="Zq#cluster", form=FORMS[5], encoded=False)
def test_no_program_prints_a_password(server, password, form, encoded):
    admin = __import__("redis").Redis.from_url(server.url, decode_responses=True)
    admin.execute_command("ACL", "SETUSER", USER, "on", "resetpass", f">{password}", "~*", "&*", "+@all")
    admin.close()
    typed = quote(password, safe="") if encoded else password
    url = form.format(user=USER, password=typed, port=server.port, dead=free_port())
    said = "\n".join(outputs_of_every_program(server, url))
    assert password not in said and quote(password, safe="") not in said and "Zq" not in said, said
