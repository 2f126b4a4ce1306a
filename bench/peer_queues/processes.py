"""The processes of a bench/peers.py run, started from the project's environment: a library's
workers, one group whose CPU time is read from /proc, and its producer processes (producer.py),
spoken to in lines."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.measure import cpu_seconds

ROOT = Path(__file__).resolve().parents[2]


class ProducerFailed(RuntimeError):
    pass


class ProducerProcess:
    """`python -m bench.peer_queues.producer APP ...` in the library's environment."""

    def __init__(
        self,
        python: str,
        app: str,
        env: dict[str, str],
        argv: list[str],
        cpus: set[int] | None = None,
        under: tuple[str, ...] = (),
    ):
        """`cpus`: the CPUs the producer (every thread it starts) may run on; None: any. `under`:
        the command it runs under (valgrind's)."""
        self.app = app
        self.process = subprocess.Popen(
            [*under, python, "-m", "bench.peer_queues.producer", app, *argv],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
        )

    @classmethod
    def one_run(cls, python: str, app: str, env: dict[str, str], argv: list[str], cpus: set[int] | None = None) -> dict:
        """Start a producer, let it run as soon as it is ready, and return its figures."""
        producer = cls(python, app, env, argv, cpus)
        producer.expect()
        producer.send()
        figures = producer.expect()
        producer.finish()
        return figures

    def expect(self) -> dict:
        """The producer's next JSON line (a library may print lines of its own)."""
        for line in self.process.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise ProducerFailed(f"the {self.app} producer exited with status {self.process.wait()}")

    def send(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()

    def finish(self) -> None:
        self.send()
        self.process.wait(timeout=60)


class WorkerGroup:
    """A library's worker processes, each the leader of a session of its own, so that stopping it
    kills the children it started (prefork pools, worker processes); their output goes to `logs`,
    shown if the run fails."""

    def __init__(self, commands: list[list[str]], env: dict[str, str], logs: Path):
        self.commands, self.env, self.logs = commands, env, logs
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> WorkerGroup:
        for i, command in enumerate(self.commands):
            with open(self.logs / f"worker-{i}.log", "w") as log:
                self.processes.append(
                    subprocess.Popen(
                        command,
                        cwd=ROOT,
                        env=self.env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        return self

    def __exit__(self, exc_type, *_) -> None:
        # SIGKILL: the server is thrown away after the run, so nothing needs a graceful drain, and
        # a library's slow shutdown (taskiq's waits up to 5 s) would only lengthen the run.
        for process in self.processes:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()
        if exc_type is not None:
            for log in sorted(self.logs.glob("worker-*.log")):
                print(f"--- {log.name}, last lines:\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)

    def pids(self) -> list[int]:
        """Every process of the workers' trees now."""
        children = child_table()
        tree, todo = [], [p.pid for p in self.processes]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(children.get(pid, ()))
        return tree

    @staticmethod
    def cpu(pids: list[int]) -> float:
        """CPU seconds of `pids` so far (a process gone since counts nothing)."""
        total = 0.0
        for pid in pids:
            try:
                total += cpu_seconds(pid)
            except (FileNotFoundError, ProcessLookupError):
                pass
        return total


@contextmanager
def pinned(pid: int, cpus: set[int]) -> Iterator[None]:
    """Every thread of process `pid` kept to `cpus` for the block, then let run where it ran before."""
    threads = [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]
    before = {tid: os.sched_getaffinity(tid) for tid in threads}
    for tid in threads:
        os.sched_setaffinity(tid, cpus)
    try:
        yield
    finally:
        for tid, allowed in before.items():
            os.sched_setaffinity(tid, allowed)


def child_table() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    return children
