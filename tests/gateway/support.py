"""The gateway as a subprocess (`python -m gateway` under uvicorn on a free port of 127.0.0.1),
and helpers to read what the queue holds."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from producer_client.keys import Keys
from tests.redis_support import REPO, free_port

GATEWAY_START_TIMEOUT_S = 60.0


class GatewayProcess:
    def __init__(self, redis_url: str, log_dir: Path, *flags: str, name: str = "gateway"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.command = [
            sys.executable, "-m", "gateway", "--redis", redis_url, "--host", "127.0.0.1", "--port", str(self.port),
            *flags,
        ]
        self.process: subprocess.Popen | None = None

    def start(self) -> GatewayProcess:
        with self.log_path.open("a") as log_file:
            self.process = subprocess.Popen(self.command, cwd=REPO, stdout=log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
        while not self._answers():
            if self.process.poll() is not None:
                raise RuntimeError(f"the gateway exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start in {GATEWAY_START_TIMEOUT_S:g}s:\n{self.log()}")
            time.sleep(0.05)
        return self

    def terminate(self, timeout: float = 30) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.terminate(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _answers(self) -> bool:
        try:
            return httpx.get(f"{self.url}/metrics", timeout=1).status_code == 200
        except httpx.TransportError:
            return False


def job_ids_in_queue(redis_client, queue: str) -> list[str]:
    """The job ids of the entries a queue's stream holds."""
    return [fields["id"] for _, fields in redis_client.xrange(Keys().queue(queue))]


def job_count(redis_client) -> int:
    """How many jobs exist in Redis: a request refused before its enqueue adds none."""
    return len(redis_client.keys(Keys().job("*")))
