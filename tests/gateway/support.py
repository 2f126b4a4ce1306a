"""What the gateway's tests share: the queues and timings of the session's gateway (conftest.py
starts it) that tests name too, a raw HTTP request (its body sent only while the gateway has not
answered), and a watch on a process's memory and spooled files."""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from pathlib import Path

TINY_QUEUE = "gw-tiny"
ECHO_QUEUE = "gw-echo"
PARKED_QUEUE = "gw-parked"  # no worker serves it until a test starts one: its jobs wait
PARKED_MODEL = "parked"
# The tiny worker's LoRA adapters: name -> write_random_adapter's arguments.
LORA_ADAPTERS = {
    "tiny-sql": {"rank": 8, "seed": 1},
    "tiny-chat": {"rank": 16, "target_modules": ("q_proj", "v_proj"), "seed": 2},
}
KEEPALIVE_S = 0.2
STREAM_HOLD_S = 3.0  # a stream of a job that waits in the queue begins after this, then keeps alive


def raw_request(
    port: int, method: str, path: str, headers: dict[str, str], chunks, chunked: bool = False
) -> tuple[int, bytes, int]:
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
    status, body = read_answer(sock)
    sock.close()
    return status, body, sent


def read_answer(sock: socket.socket) -> tuple[int, bytes]:
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
