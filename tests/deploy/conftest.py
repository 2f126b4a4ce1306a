"""Fixtures for the deployment files' tests: the files parsed, a real redis-server, and real
worker processes on the echo engine (no model: a worker is up in a few seconds)."""

from __future__ import annotations

import os
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.support import DOCKER, HEARTBEAT_INTERVAL_S, HEARTBEAT_TTL_S, load_compose
from tests.support.workers import WorkerProcess
from worker.embedded_redis import EmbeddedRedis

# Heartbeats short enough that a dead worker's expires within a test.
HEARTBEAT_FLAGS = ("--heartbeat-ttl-s", str(HEARTBEAT_TTL_S), "--heartbeat-interval-s", str(HEARTBEAT_INTERVAL_S))


@pytest.fixture(scope="session")
def compose() -> dict:
    return load_compose(DOCKER / "compose.yml")


@pytest.fixture
def redis_server() -> Iterator[EmbeddedRedis]:
    """A redis-server of the test's own (a killed worker's heartbeat outlives its test by a TTL)."""
    with EmbeddedRedis() as server:
        yield server


def remove_mili_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("MILI_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def no_mili_environment(monkeypatch):
    """WorkerSettings reads MILI_* variables, and so do the workers a test starts: the caller's
    must not leak into these checks."""
    remove_mili_variables(monkeypatch)


def echo_worker(redis_url: str, name: str | None, log_dir) -> WorkerProcess:
    """An echo worker of the default queue."""
    return WorkerProcess(redis_url, None, name, log_dir, *HEARTBEAT_FLAGS, model="echo")


@pytest.fixture
def start_worker(redis_server: EmbeddedRedis, tmp_path, no_mili_environment) -> Iterator:
    """start_worker(name=None) -> WorkerProcess on the echo engine, once its heartbeat is in
    Redis; stopped at teardown. With no name, the worker names itself <hostname>-<pid>, as it
    does in a container."""
    started: list[WorkerProcess] = []

    def start(name: str | None = None) -> WorkerProcess:
        started.append(echo_worker(redis_server.url, name, tmp_path))
        return started[-1].start().wait_ready()

    yield start
    for worker in started:
        worker.stop()


@pytest.fixture(scope="session")
def scraped_families(tmp_path_factory) -> dict[str, tuple[str, set[str]]]:
    """{family: (type, sample names)} from the /metrics endpoint of a running echo worker."""
    with pytest.MonkeyPatch.context() as monkeypatch, EmbeddedRedis() as server:
        remove_mili_variables(monkeypatch)
        worker = echo_worker(server.url, "scraped", tmp_path_factory.mktemp("scraped"))
        try:
            port = worker.start().wait_ready().heartbeat()["metrics_port"]
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        finally:
            worker.stop()
    return {f.name: (f.type, {s.name for s in f.samples}) for f in text_string_to_metric_families(body)}
