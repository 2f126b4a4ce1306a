"""The gateway as a test's process: `python -m gateway` under uvicorn on a free port of
127.0.0.1, ready once it answers /metrics."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx
import openai

from gateway.metrics import BACKLOG_TIMEOUT_S
from harness.processes import ChildProcess
from worker.embedded_redis import free_port


class GatewayProcess(ChildProcess):
    """`env`: variables set over the caller's environment."""

    stop_timeout_s = 15.0  # uvicorn's graceful shutdown closes the open streams first

    def __init__(
        self,
        redis_url: str,
        log_dir: Path,
        *flags: str,
        name: str = "gateway",
        env: Mapping[str, str] | None = None,
    ):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable,
            "-m",
            "gateway",
            "--redis",
            redis_url,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *flags,
        ]
        super().__init__(command, log_dir / f"{name}.log", {**os.environ, **(env or {})})

    def start(self) -> GatewayProcess:
        """Started and answering: a gateway starts in about a second. At its first start the port
        free_port() found may be taken before uvicorn binds it (by any socket of the machine's,
        an outgoing connection's included: CI met it once); the gateway then starts again on
        another free port (ChildProcess.on_a_free_port). A restart keeps its port, which the test
        holds."""
        return self.on_a_free_port(self._start_once, self.move_to)

    def _start_once(self) -> GatewayProcess:
        super().start()
        return self.wait_ready()

    def move_to(self, port: int) -> None:
        self.command[self.command.index("--port") + 1] = str(port)
        self.port, self.url = port, f"http://127.0.0.1:{port}"

    def ready(self) -> bool:
        # A restart keeps the port, which another test's process may have taken meanwhile: it would
        # answer the probe while this gateway fails to bind. The gateway's line says the port is ours.
        if f"listening on {self.url}\n" not in self.log_of_this_start():  # the line, not a longer port
            return False
        try:
            # Answered, 200 or 401 (monitoring_needs_key); a scrape reads the queues' backlogs, up to
            # gateway.metrics.BACKLOG_TIMEOUT_S while Redis is away (a test's dead or silent Redis).
            httpx.get(f"{self.url}/metrics", timeout=BACKLOG_TIMEOUT_S + 1)
            return True
        except httpx.TransportError:
            return False


def slowest_answer_while(url: str, work: Callable[[], object], path: str = "/health") -> tuple[object, float, float]:
    """(work()'s outcome, its seconds, the slowest answer to GET `path` asked from another
    connection every few milliseconds meanwhile)."""
    done = threading.Event()
    slowest = [0.0]

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=120) as client:
            client.get(path)  # connected before the clock runs
            ready.set()
            while not done.is_set():
                started = time.monotonic()
                client.get(path)
                slowest[0] = max(slowest[0], time.monotonic() - started)
                time.sleep(0.005)

    ready = threading.Event()
    prober = threading.Thread(target=probe)
    prober.start()
    ready.wait(60)
    started = time.monotonic()
    try:
        outcome: object = work()
    except openai.APIError as e:
        outcome = e
    took = time.monotonic() - started
    done.set()
    prober.join()
    return outcome, took, slowest[0]
