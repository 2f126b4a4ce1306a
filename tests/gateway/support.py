"""The gateway as a subprocess (`python -m gateway` under uvicorn on a free port of 127.0.0.1),
helpers to read what the queue holds, a raw HTTP request (its body sent only while the gateway
has not answered), and a watch on a process's memory and spooled files."""
from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from producer_client.keys import Keys
from tests.redis_support import REPO, free_port

GATEWAY_START_TIMEOUT_S = 60.0


class GatewayProcess:
    def __init__(self, redis_url: str, log_dir: Path, *flags: str, name: str = "gateway", env: dict | None = None):
        self.port = free_port()
        self.env = None if env is None else {**os.environ, **env}
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self.command = [
            sys.executable, "-m", "gateway", "--redis", redis_url, "--host", "127.0.0.1", "--port", str(self.port),
            *flags,
        ]
        self.process: subprocess.Popen | None = None

    def start(self) -> GatewayProcess:
        with self.log_path.open("a") as log_file:
            self.process = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdout=log_file, stderr=subprocess.STDOUT)
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
            httpx.get(f"{self.url}/metrics", timeout=1)  # answered, 200 or 401 (monitoring_needs_key)
            return True
        except httpx.TransportError:
            return False


def job_ids_in_queue(redis_client, queue: str) -> list[str]:
    """The job ids of the entries a queue's stream holds."""
    return [fields["id"] for _, fields in redis_client.xrange(Keys().queue(queue))]


def job_count(redis_client) -> int:
    """How many jobs exist in Redis: a request refused before its enqueue adds none."""
    return len(redis_client.keys(Keys().job("*")))


def raw_request(port: int, method: str, path: str, headers: dict[str, str], chunks, chunked: bool = False) -> tuple[int, bytes, int]:
    """One HTTP/1.1 request over a socket, its body sent chunk by chunk until the gateway answers
    (or closes): (status, body, body bytes sent). The answer is read as soon as it comes, so that
    one sent before the body was read is seen even though the body never was."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock.sendall((head + ("Transfer-Encoding: chunked\r\n" if chunked else "") + "\r\n").encode())
    sent = 0
    answered = bool(select.select([sock], [], [], 0.3)[0])
    try:
        for chunk in chunks:
            if answered or select.select([sock], [], [], 0)[0]:
                break
            sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n" if chunked else chunk)
            sent += len(chunk)
        else:
            if chunked:
                sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass
    status, body = _read_answer(sock)
    sock.close()
    return status, body, sent


def _read_answer(sock: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        if not more:
            raise ConnectionError(f"closed before an answer: {data!r}")
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    length = next((int(line.split(":", 1)[1]) for line in lines if line.lower().startswith("content-length:")), 0)
    while len(body) < length:
        more = sock.recv(65536)
        if not more:
            break
        body += more
    return int(lines[0].split()[1]), body


class ResourceWatch:
    """Samples a process while a request runs: its resident memory's growth over where it stood,
    and the bytes of the files under `spool_dir` it holds open (spooled uploads are unlinked
    temporary files, seen through /proc/PID/fd)."""

    def __init__(self, pid: int, spool_dir: Path):
        self.pid = pid
        self.spool_dir = str(spool_dir)
        self.rss_before = self._rss()
        self.max_rss_growth = 0
        self.max_spooled = 0
        self.running = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> ResourceWatch:
        self.running.set()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.running.clear()
        self.thread.join()

    def _sample(self) -> None:
        while self.running.is_set():
            self.max_rss_growth = max(self.max_rss_growth, self._rss() - self.rss_before)
            self.max_spooled = max(self.max_spooled, self._spooled())
            time.sleep(0.002)

    def _rss(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def _spooled(self) -> int:
        total = 0
        fds = Path(f"/proc/{self.pid}/fd")
        for fd in list(fds.iterdir()) if fds.exists() else []:
            try:
                if os.readlink(fd).startswith(self.spool_dir):
                    total += os.stat(fd).st_size
            except OSError:  # closed meanwhile
                continue
        return total
