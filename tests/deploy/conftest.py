"""Fixtures for the deployment files' tests: the files parsed, a real redis-server, and real
worker processes on the echo engine (no model: a worker is up in a few seconds)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from harness.polling import eventually
from producer_client import Client
from tests.deploy.support import (
    DOCKER,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TTL_S,
    Families,
    exported_names,
    families_at,
    load_compose,
)
from tests.support.gateways import GatewayProcess
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
def scraped(tmp_path_factory) -> dict[str, Families]:
    """The /metrics of a running echo worker and of a gateway on its Redis ({"worker": ...,
    "gateway": ...}), scraped after the worker served a tenant's flex job: the series labelled by
    lane and tenant exist."""
    log_dir = tmp_path_factory.mktemp("scraped")
    with pytest.MonkeyPatch.context() as monkeypatch, EmbeddedRedis() as server:
        remove_mili_variables(monkeypatch)
        worker, gateway = echo_worker(server.url, "scraped", log_dir), GatewayProcess(server.url, log_dir)
        try:
            port = worker.start().wait_ready().heartbeat()["metrics_port"]
            gateway.start()
            with Client(server.url, tenant="team-a") as client:
                client.result(client.submit(prompt="scraped", max_tokens=8, service_tier="flex"), timeout=30)
            # The worker adds the tokens it served to its metrics at its next heartbeat.
            worker_url = f"http://127.0.0.1:{port}/metrics"
            served = lambda: "mili_served_tokens_total" in exported_names(families_at(worker_url))  # noqa: E731
            assert eventually(served, timeout=10), worker.log()
            return {"worker": families_at(worker_url), "gateway": families_at(f"{gateway.url}/metrics")}
        finally:
            gateway.stop()
            worker.stop()


@pytest.fixture(scope="session")
def scraped_families(scraped) -> Families:
    """The families of a running echo worker's /metrics."""
    return scraped["worker"]
