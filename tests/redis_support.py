"""Shared by tests/queue and tests/e2e: a real redis-server on a free port, worker processes,
and AsyncClient behind Client's synchronous interface so one test body checks both."""
from __future__ import annotations

import asyncio
import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from producer_client import AsyncClient, Client
from producer_client.keys import Keys
from worker.embedded_redis import EmbeddedRedis

REPO = Path(__file__).resolve().parents[1]
WORKER_START_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis(port=free_port()) as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


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

    def __init__(self, redis_url: str, queue: str, name: str, log_dir: Path, *flags: str, model: str = "tiny"):
        self.redis_url = redis_url
        self.queue = queue
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self.command = [
            sys.executable, "-m", "worker", "serve", "--model", model, "--redis", redis_url, "--queue", queue,
            "--name", name, "--metrics-host", "127.0.0.1", "--metrics-port", "0", "--heartbeat-interval-s", "0.1",
            "--block-ms", "100", "--kv-cache-mib", "64", *flags,
        ]
        self.process: subprocess.Popen | None = None
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)

    def start(self) -> WorkerProcess:
        log_file = self.log_path.open("w")
        # One torch thread each: workers share this machine's cores with each other and
        # with the tests, and oversubscribed threads make every step several times slower.
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
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
