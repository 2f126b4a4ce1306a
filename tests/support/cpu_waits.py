"""How long processes waited for a CPU, over time: what a timing test may excuse, and nothing else.

A worker's promise on time (docs/architecture.md: a streamed job's tokens within stream_interval_s)
holds while its host keeps up. On a shared machine the kernel may leave the worker's threads, or
Redis, runnable and waiting for a core for tens of milliseconds; no worker can make that up. The
kernel counts that wait per thread (/proc/PID/task/TID/schedstat, its second field, in ns), so a
test can measure it over an interval and allow exactly that much on top of the promised bound: on
a quiet machine that is nothing, and the bound is as strict as the promise."""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_left, bisect_right
from pathlib import Path

SAMPLE_INTERVAL_S = 0.005


def run_queue_wait_ns(task: Path) -> int | None:
    """The time the thread has spent runnable and waiting for a CPU since it started; None if it
    has exited."""
    try:
        return int((task / "schedstat").read_text().split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None


class CpuWaits:
    """Samples every SAMPLE_INTERVAL_S, on a thread of its own (not counted), the time the threads
    of `pids` have waited for a CPU in all, from the start on: between two samples, the sum of each
    thread's own increase (a thread that starts counts from when it is first seen)."""

    def __init__(self, *pids: int):
        self.tasks = [Path(f"/proc/{pid}/task") for pid in pids]
        self.times: list[float] = []
        self.waited_s: list[float] = []
        self.last_ns: dict[Path, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample_until_stopped, name="cpu-waits", daemon=True)

    def __enter__(self) -> CpuWaits:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def during(self, start: float, end: float) -> float:
        """Seconds waited between `start` and `end` (time.time()), from the last sample at or before
        `start` to the first at or after `end`: never less than the threads waited then."""
        first = max(0, bisect_right(self.times, start) - 1)
        last = min(len(self.times) - 1, bisect_left(self.times, end))
        return self.waited_s[last] - self.waited_s[first]

    def _sample_until_stopped(self) -> None:
        own = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}")
        total_ns = 0
        while True:
            total_ns += self._increase_ns(own)
            self.times.append(time.time())
            self.waited_s.append(total_ns / 1e9)
            if self.stop.wait(SAMPLE_INTERVAL_S):
                return

    def _increase_ns(self, own: Path) -> int:
        increase = 0
        for tasks in self.tasks:
            for task in tasks.iterdir():
                now = run_queue_wait_ns(task) if task != own else None
                if now is not None:
                    increase += now - self.last_ns.get(task, now)
                    self.last_ns[task] = now
        return increase
