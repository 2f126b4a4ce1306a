"""The gateway as a test's process: `python -m gateway` under uvicorn on a free port of
127.0.0.1, ready once it answers /metrics."""
from __future__ import annotations

import sys
from pathlib import Path

import httpx

from tests.support.processes import ChildProcess
from worker.embedded_redis import free_port


class GatewayProcess(ChildProcess):
    stop_timeout_s = 15.0  # uvicorn's graceful shutdown closes the open streams first

    def __init__(self, redis_url: str, log_dir: Path, *flags: str, name: str = "gateway"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "gateway", "--redis", redis_url, "--host", "127.0.0.1", "--port", str(self.port), *flags,
        ]
        super().__init__(command, log_dir / f"{name}.log")

    def start(self) -> GatewayProcess:
        """Started and answering: a gateway starts in about a second."""
        super().start()
        return self.wait_ready()

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/metrics", timeout=1).status_code == 200
        except httpx.TransportError:
            return False
