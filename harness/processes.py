"""The one class for the processes tests start: a command, its output in a log file, a
readiness probe, and a stop that leaves nothing behind (worker.embedded_redis.stop_process:
SIGTERM, then SIGKILL); and the one way a benchmark starts a worker process (`start_worker`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from harness.polling import eventually
from worker.embedded_redis import free_port, stop_process

REPO = Path(__file__).resolve().parents[1]  # the checkout: harness/ sits at its root
T = TypeVar("T")
WORKER_MODULE = ("-m", "worker")  # the interpreter's arguments before `serve`: the worker's own entry
PROBE_INTERVAL_S = 0.05  # a probe opens a connection or sends a request: not every 10 ms


def alive(pid: int) -> bool:
    """Running: neither gone nor a zombie its parent has not reaped. A SIGKILLed process still shows
    as running while the kernel tears it down, after it has closed its files: wait for the change
    (`eventually`) rather than read it once."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def start_worker(
    redis_url: str,
    queue: str,
    *flags: str,
    name: str | None = None,
    model: str = "echo",
    log_path: Path | None = None,
    tree: Path = REPO,
    env: Mapping[str, str] | None = None,
    launcher: Sequence[str] = WORKER_MODULE,
) -> subprocess.Popen:
    """`python -m worker serve` of `model` on `queue`, as a benchmark runs one: the echo engine by
    default (no model: a job's output is its prompt, one token a step), metrics on a free port of
    127.0.0.1, warnings only, written to `log_path` (else to this process's output); `flags` come
    last, so they override these. `tree`: the source tree it runs from (by default this one; a
    worktree of an older commit, to compare against), with only that directory on PYTHONPATH and,
    for another tree, that tree's `.venv/bin/python` if it has one. `env`: variables set over this
    process's environment. `launcher`: what the interpreter runs (`-m worker`, or a script that runs
    the tree's worker its own way, as bench/device_pace.py). Readiness is the caller's: its warm-up
    jobs wait for the worker."""
    tree = tree.resolve()
    own_python = tree / ".venv" / "bin" / "python"
    python = str(own_python) if tree != REPO and own_python.exists() else sys.executable
    command = serve_command(python, redis_url, model, queue, name, "--log-level", "WARNING", *flags, launcher=launcher)
    env = {**os.environ, "PYTHONPATH": str(tree), **(env or {})}
    if log_path is None:
        return subprocess.Popen(command, cwd=tree, env=env, stdin=subprocess.DEVNULL)
    with log_path.open("w") as log_file:
        return subprocess.Popen(
            command, cwd=tree, env=env, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT
        )


def serve_command(
    python: str,
    redis_url: str,
    model: str,
    queue: str | None,
    name: str | None,
    *flags: str,
    launcher: Sequence[str] = WORKER_MODULE,
) -> list[str]:
    """The command line of `python -m worker serve` of `model` on `queue` (None: the worker's
    default queue), named `name` (None: <hostname>-<pid>), with metrics on a free port of
    127.0.0.1, a benchmark's and a test's alike; `flags` come last, so they override these."""
    return [
        *(python, *launcher, "serve", "--model", model, "--redis", redis_url),
        *("--metrics-host", "127.0.0.1", "--metrics-port", "0"),
        *(["--queue", queue] if queue is not None else []),
        *(["--name", name] if name is not None else []),
        *flags,
    ]


PORT_TRIES = 3
PORT_TAKEN = "address already in use"  # a bind's errno 98, in redis-server's and the gateway's words (any case)


class ProcessNotReady(RuntimeError):
    """A started process exited, or did not answer its probe in time; the message holds its log."""


class ProcessStuck(RuntimeError):
    """A process did not exit after SIGTERM; the message holds its log."""


class ChildProcess:
    """A process of a test, run from the repository's root. Subclasses name the command and
    override `ready`. The log file is emptied when the object is made and appended to by each
    start, so a process started again keeps the story of its earlier runs."""

    start_timeout_s = 60.0
    stop_timeout_s = 10.0  # how long SIGTERM has (a worker's drain, a redis-server's AOF) before SIGKILL

    def __init__(self, command: list[str], log_path: Path, env: Mapping[str, str] | None = None):
        self.command = command
        self.log_path = log_path
        self.env = dict(os.environ if env is None else env)
        self.process: subprocess.Popen | None = None
        self.log_offset = 0  # where the current start's part of the log begins
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.write_text("")

    def ready(self) -> bool:
        """The readiness probe: True once the process serves."""
        return True

    def start(self):
        self.log_offset = self.log_path.stat().st_size
        with self.log_path.open("a") as log_file:
            self.process = subprocess.Popen(
                self.command,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
            )
        return self

    def wait_ready(self):
        if not eventually(lambda: not self.running or self.ready(), self.start_timeout_s, PROBE_INTERVAL_S):
            raise ProcessNotReady(f"{self} not ready in {self.start_timeout_s:g}s:\n{self.log()}")
        if not self.running:
            raise ProcessNotReady(f"{self} exited with {self.process.returncode}:\n{self.log()}")
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM, and its exit code once it has exited by itself. One still running `timeout`
        seconds later is killed, and the test fails with its log."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ProcessStuck(f"{self} still running {timeout:g}s after SIGTERM:\n{self.log()[-8000:]}") from None

    def kill(self) -> None:
        """SIGKILL: no shutdown, nothing handed over or written out."""
        self.process.kill()
        self.process.wait()

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a process a test left stopped would ignore SIGTERM
        stop_process(self.process, self.stop_timeout_s)

    def on_a_free_port(self, start: Callable[[], T], move_to: Callable[[int], None]) -> T:
        """`start()` (a start that waits until ready). At the first start only, the port free_port()
        found may be taken before the process binds it (by a server another test started in
        between, or any socket of the machine's, an outgoing connection's included): when this
        start's log says so, the process is moved to another free port (`move_to`) and started
        again, PORT_TRIES starts in all. A restart keeps its port, as others know it."""
        first = self.process is None
        for _ in range(PORT_TRIES - 1):
            try:
                return start()
            except ProcessNotReady:
                if not first or PORT_TAKEN not in self.log_of_this_start().lower():
                    raise
            move_to(free_port())
        return start()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_of_this_start(self) -> str:
        with self.log_path.open("rb") as log_file:
            log_file.seek(self.log_offset)
            return log_file.read().decode(errors="replace")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.log_path.stem})"
