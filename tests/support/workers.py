"""`python -m worker serve` as a test's process: ready once its heartbeat is in Redis."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from harness.processes import ChildProcess, serve_command
from producer_client.connection import connect
from producer_client.keys import Keys

# Recovery settings small enough for a test: an entry idle for a second is reclaimed, and workers
# look for one every 0.2 s (a WorkerProcess heartbeats every 0.1 s).
FAST_RECLAIM = ("--claim-idle-ms", "1000", "--reclaim-interval-s", "0.2")


class WorkerProcess(ChildProcess):
    """A worker with a test's timings (heartbeats every 0.1 s, a Redis read blocks 100 ms at most)
    and a small KV cache; `flags` come last, so they override these. With no `name`, the worker
    names itself <hostname>-<pid>, as in a container. `env`: variables set over the caller's
    environment."""

    start_timeout_s = 300.0  # a model's load, on a loaded machine

    def __init__(
        self,
        redis_url: str,
        queue: str | None,
        name: str | None,
        log_dir: Path,
        *flags: str,
        model: str = "tiny",
        env: Mapping[str, str] | None = None,
    ):
        self.queue = queue
        self.name = name
        test_timings = ("--heartbeat-interval-s", "0.1", "--block-ms", "100", "--redis-backoff-max-s", "0.5")
        command = serve_command(
            sys.executable, redis_url, model, queue, name, *test_timings, "--kv-cache-mib", "64", *flags
        )
        # One torch thread each: workers share this machine's cores with each other and with the
        # tests, and oversubscribed threads make every step several times slower.
        env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        super().__init__(command, log_dir / f"{name or 'worker'}.log", env)
        self.redis = connect(redis_url, decode_responses=True)

    def start(self) -> WorkerProcess:
        super().start()
        if self.name is None:
            self.name = f"{socket.gethostname()}-{self.process.pid}"
        return self

    def ready(self) -> bool:
        return bool(self.redis.exists(Keys().worker(self.name)))

    def heartbeat(self) -> dict[str, str]:
        return self.redis.hgetall(Keys().worker(self.name))

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then wait for the drain to end."""
        return super().terminate(timeout)

    def stop(self) -> None:
        super().stop()
        self.redis.close()


def start_workers(workers: list[WorkerProcess]) -> list[WorkerProcess]:
    """Start all, then wait for all: their model loads overlap."""
    for w in workers:
        w.start()
    for w in workers:
        w.wait_ready()
    return workers


@contextmanager
def echo_workers(
    redis_url: str, queue: str, log_dir: Path, *flags: str, count: int = 2, env: Mapping[str, str] | None = None
) -> Iterator[list[WorkerProcess]]:
    """`count` echo workers of `queue` (named after it), started, then stopped at the end."""
    workers = [
        WorkerProcess(redis_url, queue, f"{queue}-{i}", log_dir, *flags, model="echo", env=env) for i in range(count)
    ]
    try:
        yield start_workers(workers)
    finally:
        for w in workers:
            w.stop()
