"""Shared by tests/queue, tests/e2e and tests/chaos: a real redis-server on a free port, a Redis
Cluster and a Sentinel setup (tests/redis_modes.py), `redis_deployment` to run a test on each of
the three, worker processes, and AsyncClient behind Client's synchronous interface so one test
body checks both."""
from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from producer_client import AsyncClient, Client
from producer_client.connection import connect
from producer_client.keys import Keys
from tests.redis_modes import LocalCluster, LocalSentinel, free_port
from worker.embedded_redis import EmbeddedRedis

REPO = Path(__file__).resolve().parents[1]
WORKER_START_TIMEOUT_S = 300.0


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis(port=free_port()) as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory):
    with LocalSentinel(tmp_path_factory.mktemp("sentinel")) as setup:
        yield setup


MODES = {"server": "redis_server", "cluster": "redis_cluster", "sentinel": "redis_sentinel"}


@pytest.fixture(scope="session", params=list(MODES))
def redis_deployment(request):
    """Each of the three modes in turn, one instance of each per session: its `url`."""
    return request.getfixturevalue(MODES[request.param])


def on_modes(*modes: str):
    """Runs a test that uses redis_deployment on `modes` only (their instances are the session's,
    shared with the tests that run on all three): what does not depend on the mode runs on one
    server alone, to keep the suite quick."""
    return pytest.mark.parametrize("redis_deployment", list(modes), indirect=True)


SERVER_ONLY = on_modes("server")


@pytest.fixture
def deployment_client(redis_deployment):
    """A client of the deployment in its mode, for what a test reads and checks."""
    client = connect(redis_deployment.url, decode_responses=True)
    yield client
    client.close()


def events(redis_client, job_id: str) -> list[tuple[str, str, dict]]:
    """(event id, type, data) of each event in the job's stream."""
    return [(event_id, f["type"], json.loads(f["data"])) for event_id, f in redis_client.xrange(Keys().events(job_id))]


def tokens_published(redis_client, job_id: str) -> list[int]:
    return [t for _, kind, data in events(redis_client, job_id) if kind == "tokens" for t in data["ids"]]


def runs(redis_client, job_id: str) -> list[tuple[dict, list[int]]]:
    """Each run of the job: its start event's data (plus `at`, when Redis added the event), and
    the tokens it published."""
    out: list[tuple[dict, list[int]]] = []
    for event_id, kind, data in events(redis_client, job_id):
        if kind == "start":
            out.append(({**data, "at": int(event_id.split("-")[0]) / 1000}, []))
        elif kind == "tokens":
            out[-1][1].extend(data["ids"])
    return out


def assert_one_final_result(redis_client, job_id: str) -> None:
    assert [kind for _, kind, _ in events(redis_client, job_id)].count("end") == 1, job_id
    assert redis_client.xlen(Keys().done(job_id)) == 1, job_id


def eventually(condition, timeout: float = 10.0) -> bool:
    """For effects that follow the result a client sees: the worker acks an entry, counts a
    job in its metrics and refreshes its heartbeat after the job's result is out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class SyncView:
    """An AsyncClient driven on its own event loop, with Client's synchronous methods."""

    def __init__(self, client: AsyncClient):
        self.client = client
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, name):
        attr = getattr(self.client, name)
        if inspect.isasyncgenfunction(attr):
            return lambda *a, **kw: self._iterate(attr(*a, **kw))
        if inspect.iscoroutinefunction(attr):
            return lambda *a, **kw: self.loop.run_until_complete(attr(*a, **kw))
        return attr

    def _iterate(self, agen):
        while True:
            try:
                yield self.loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


def make_client(kind: str, url: str, queue: str, **kwargs) -> Client | SyncView:
    if kind == "sync":
        return Client(url, queue, **kwargs)
    return SyncView(AsyncClient(url, queue, **kwargs))


@pytest.fixture(params=["sync", "async"])
def client_kind(request) -> str:
    return request.param


class WorkerProcess:
    """`python -m worker serve` as a subprocess, its log in a file, ready once it heartbeats."""

    def __init__(
        self, redis_url: str, queue: str, name: str, log_dir: Path, *flags: str, model: str = "tiny",
        env: dict[str, str] | None = None,
    ):
        self.redis_url = redis_url
        self.env = env or {}
        self.queue = queue
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.command = [
            sys.executable, "-m", "worker", "serve", "--model", model, "--redis", redis_url, "--queue", queue,
            "--name", name, "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--heartbeat-interval-s", "0.1",
            "--block-ms", "100", "--redis-backoff-max-s", "0.5", "--kv-cache-mib", "64", *flags,
        ]
        self.process: subprocess.Popen | None = None
        self.redis = connect(redis_url, decode_responses=True)

    def start(self) -> WorkerProcess:
        log_file = self.log_path.open("w")
        # One torch thread each: workers share this machine's cores with each other and
        # with the tests, and oversubscribed threads make every step several times slower.
        env = {**os.environ, "OMP_NUM_THREADS": "1", **self.env}
        self.process = subprocess.Popen(self.command, cwd=REPO, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        log_file.close()
        return self

    def wait_ready(self) -> WorkerProcess:
        deadline = time.monotonic() + WORKER_START_TIMEOUT_S
        while not self.redis.exists(Keys().worker(self.name)):
            if self.process.poll() is not None:
                raise RuntimeError(f"worker {self.name} exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {self.name} not ready in {WORKER_START_TIMEOUT_S:g}s:\n{self.log()}")
            time.sleep(0.05)
        return self

    def heartbeat(self) -> dict[str, str]:
        return self.redis.hgetall(Keys().worker(self.name))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then wait for the drain to end."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.terminate(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.redis.close()


def start_workers(workers: list[WorkerProcess]) -> list[WorkerProcess]:
    """Start all, then wait for all: their model loads overlap."""
    for w in workers:
        w.start()
    for w in workers:
        w.wait_ready()
    return workers


@contextmanager
def echo_workers(redis_url: str, queue: str, log_dir: Path, *flags: str, count: int = 2) -> Iterator[list[WorkerProcess]]:
    """`count` echo workers of `queue` (named after it), started, then stopped at the end."""
    workers = [WorkerProcess(redis_url, queue, f"{queue}-{i}", log_dir, *flags, model="echo") for i in range(count)]
    try:
        yield start_workers(workers)
    finally:
        for w in workers:
            w.stop()


class RestartableRedis:
    """A redis-server on a fixed TCP port with AOF (appendfsync everysec), as deployments run it,
    that a test can stop and start again on the same port and data directory."""

    def __init__(self, data_dir: Path):
        self.dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> RestartableRedis:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--logfile", "redis.log"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        try:
            assert eventually(lambda: self._answers(client), timeout=10), (self.dir / "redis.log").read_text()
        finally:
            client.close()
        return self

    def stop(self) -> None:
        """SIGTERM: Redis writes out its AOF and exits, as in a restart or an upgrade."""
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None

    def restart(self, down_s: float, keep_data: bool = True) -> None:
        """Stop, wait `down_s`, start again; with keep_data=False the AOF goes first, so Redis
        comes back empty, as one without persistence does."""
        self.stop()
        if not keep_data:
            shutil.rmtree(self.dir / "appendonlydir", ignore_errors=True)
        time.sleep(down_s)
        self.start()

    @staticmethod
    def _answers(client: redis.Redis) -> bool:
        try:
            return client.ping()
        except redis.ConnectionError:  # not listening yet, or loading the AOF
            return False


@pytest.fixture
def restartable_redis(tmp_path):
    server = RestartableRedis(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def redis_client_of():
    """redis_client_of(server): a client of that server, closed after the test."""
    clients = []

    def connect(server) -> redis.Redis:
        clients.append(redis.Redis.from_url(server.url, decode_responses=True))
        return clients[-1]

    yield connect
    for c in clients:
        c.close()
