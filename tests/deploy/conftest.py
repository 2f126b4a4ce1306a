"""Fixtures for the deployment files' tests: the files parsed, a real redis-server, and real
worker processes on the echo engine (no model: a worker is up in a few seconds)."""
from __future__ import annotations

import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from producer_client.keys import Keys
from tests.deploy.support import (
    DOCKER, HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, ROOT, environment_without_mili, load_compose, wait_for,
)
from worker.embedded_redis import EmbeddedRedis

WORKER_START_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def compose() -> dict:
    return load_compose(DOCKER / "compose.yml")


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own (a killed worker's heartbeat outlives its test by a TTL)."""
    with EmbeddedRedis() as server:
        yield server


class WorkerProcess:
    def __init__(self, process: subprocess.Popen, name: str, client: redis.Redis, keys: Keys):
        self.process = process
        self.name = name
        self.client = client
        self.keys = keys

    def heartbeat(self) -> dict[str, str]:
        return self.client.hgetall(self.keys.worker(self.name))

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # in case a test left it stopped
            self.process.kill()
        self.process.wait()


@pytest.fixture
def start_worker(redis_server: EmbeddedRedis) -> Iterator:
    """start_worker(name=None) -> WorkerProcess on the echo engine, once its heartbeat is in
    Redis; killed at teardown. With no name, the worker names itself <hostname>-<pid>, as it
    does in a container."""
    started: list[WorkerProcess] = []
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)

    def start(name: str | None = None) -> WorkerProcess:
        args = [
            sys.executable, "-m", "worker", "serve", "--model", "echo", "--redis", redis_server.url,
            "--metrics-host", "127.0.0.1", "--metrics-port", "0",
            "--heartbeat-ttl-s", str(HEARTBEAT_TTL_S), "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S),
        ]
        if name is not None:
            args += ["--name", name]
        process = subprocess.Popen(
            args, cwd=ROOT, env=environment_without_mili(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        worker = WorkerProcess(process, name or f"{socket.gethostname()}-{process.pid}", client, Keys())
        started.append(worker)
        wait_for(lambda: worker.heartbeat() or process.poll() is not None, WORKER_START_TIMEOUT_S, "the worker's heartbeat")
        assert process.poll() is None, f"worker exited with {process.returncode}"
        return worker

    yield start
    for worker in started:
        worker.stop()
    client.close()


@pytest.fixture(scope="session")
def scraped_families() -> dict[str, tuple[str, set[str]]]:
    """{family: (type, sample names)} from the /metrics endpoint of a running echo worker."""
    with EmbeddedRedis() as server:
        process = subprocess.Popen(
            [sys.executable, "-m", "worker", "serve", "--model", "echo", "--redis", server.url, "--name", "scraped",
             "--metrics-host", "127.0.0.1", "--metrics-port", "0"],
            cwd=ROOT, env=environment_without_mili(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        )
        try:
            client = redis.Redis.from_url(server.url, decode_responses=True)
            port = wait_for(
                lambda: client.hget(Keys().worker("scraped"), "metrics_port") or process.poll() is not None,
                WORKER_START_TIMEOUT_S, "the worker's heartbeat",
            )
            assert process.poll() is None, f"worker exited with {process.returncode}"
            client.close()
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        finally:
            process.kill()
            process.wait()
    return {f.name: (f.type, {s.name for s in f.samples}) for f in text_string_to_metric_families(body)}
