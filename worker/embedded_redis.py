"""A private redis-server for one-host runs, the demo and the tests: its own temp dir,
listening on a unix socket (or on 127.0.0.1:port), no persistence, stopped on exit."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis

from producer_client.errors import MiliError

START_TIMEOUT_S = 10.0
INSTALL_HINT = (
    "redis-server was not found on PATH. Install it (Debian/Ubuntu: sudo apt-get install redis-server; "
    "macOS: brew install redis; offline: scripts/bootstrap.sh --offline BUNDLE puts one in the venv), or point "
    "the worker at a running Redis with --redis redis://HOST:6379/0."
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a server started next (EmbeddedRedis(port=...), a gateway)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_process(process: subprocess.Popen, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout_s` (a redis-server writes out
    its AOF, a worker drains, on SIGTERM: both get the time to)."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def redis_server_binary() -> str | None:
    """redis-server on PATH, else the one beside this interpreter: scripts/bootstrap.sh --offline puts
    a bundled one in the venv's bin, which is not on PATH unless the venv is activated."""
    return shutil.which("redis-server") or shutil.which("redis-server", path=str(Path(sys.executable).parent))


class RedisServerError(MiliError):
    code = "redis_server_error"


class EmbeddedRedis:
    def __init__(self, port: int | None = None):
        """`port`: listen on 127.0.0.1:port; None: a unix socket in the temp dir (no TCP at all)."""
        self.port = port
        self.dir: Path | None = None
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        if self.port is not None:
            return f"redis://127.0.0.1:{self.port}/0"
        return f"unix://{self.dir / 'redis.sock'}"

    def start(self) -> EmbeddedRedis:
        binary = redis_server_binary()
        if binary is None:
            raise RedisServerError(INSTALL_HINT)
        self.dir = Path(tempfile.mkdtemp(prefix="mili-redis-"))
        listen = ["--port", "0", "--unixsocket", str(self.dir / "redis.sock"), "--unixsocketperm", "700"]
        if self.port is not None:
            listen = ["--port", str(self.port), "--bind", "127.0.0.1"]
        self.process = subprocess.Popen(
            [
                binary,
                *listen,
                "--dir",
                str(self.dir),
                "--save",
                "",
                "--appendonly",
                "no",
                "--logfile",
                str(self.dir / "redis.log"),
                "--daemonize",
                "no",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_ready()
        return self

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process, timeout_s=10)
            self.process = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        client = redis.Redis.from_url(self.url)
        try:
            while True:
                if self.process.poll() is not None:
                    log_file = self.dir / "redis.log"
                    log = log_file.read_text(errors="replace")[-2000:] if log_file.exists() else ""
                    self.stop()
                    raise RedisServerError(f"redis-server exited at start:\n{log}")
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RedisServerError(f"redis-server did not answer within {START_TIMEOUT_S:g}s") from None
                    time.sleep(0.01)
        finally:
            client.close()
