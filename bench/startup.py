"""A worker's time to its first served job, from the moment its process is spawned: a job waits in
the queue, a `python -m worker serve` starts, and the clock stops when the job's result is there.

  first  a first start: a preset's checkpoint not written yet, numba's compiled kernels not cached
         (MILI_CACHE_DIR and NUMBA_CACHE_DIR point at fresh directories)
  warm   each later start, with both caches as the first start left them

For each start: the time to the first job, the worker's CPU time by then, the longest silence
between two of its log lines before the job was served (what a user watching the log waits
through), and with --lines every log line it wrote by then, at its time since the spawn.

    python -m bench.startup                                  # tiny: a first start and 3 warm ones
    python -m bench.startup --model small --warm 2 --lines
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench.measure import cpu_seconds
from producer_client import Client
from worker.embedded_redis import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "startup"
# The record's message, after the format's time, level, [worker name] and logger name.
RECORD = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ (?:INFO|WARNING|ERROR|CRITICAL|DEBUG) \[[^]]*\] (?P<text>.*)$")


@dataclass
class Start:
    kind: str
    first_job_s: float
    cpu_s: float
    lines: list[tuple[float, str]] = field(default_factory=list)

    @property
    def longest_silence_s(self) -> float:
        times = [0.0] + [at for at, _ in self.lines if at <= self.first_job_s] + [self.first_job_s]
        return max(b - a for a, b in zip(times, times[1:]))


def main() -> None:
    args = parse_args()
    print(f"model {args.model}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at the start")
    with tempfile.TemporaryDirectory(prefix="mili-startup-") as caches, EmbeddedRedis() as redis_server:
        env = {
            **os.environ,
            "MILI_CACHE_DIR": str(Path(caches) / "mili"),
            "NUMBA_CACHE_DIR": str(Path(caches) / "numba"),
            "OMP_NUM_THREADS": str(args.threads),
        }
        starts = [start_once(args.model, "first", env, redis_server.url, args.worker_flags)]
        starts += [start_once(args.model, "warm", env, redis_server.url, args.worker_flags) for _ in range(args.warm)]
    for start in starts:
        print(
            f"{start.kind:5}  first job {start.first_job_s:6.1f} s   worker CPU {start.cpu_s:6.1f} s   "
            f"longest silence {start.longest_silence_s:5.1f} s"
        )
        if args.lines:
            for at, text in start.lines:
                print(f"      {at:6.1f} s  {text}")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--warm", type=int, default=3, help="warm starts after the first")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the worker")
    parser.add_argument("--lines", action="store_true", help="print each start's log lines with their times")
    parser.add_argument("--worker-flags", nargs=argparse.REMAINDER, default=[], help="more flags for the worker (last)")
    return parser.parse_args()


def start_once(model: str, kind: str, env: dict[str, str], url: str, flags: list[str]) -> Start:
    with Client(url, QUEUE) as client:
        job_id = client.submit("Hello", max_tokens=1, temperature=0)
        command = [sys.executable, "-m", "worker", "serve", "--model", model, "--redis", url, "--queue", QUEUE]
        spawned = time.monotonic()
        worker = subprocess.Popen(
            [*command, "--metrics-port", "0", *flags], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True
        )
        lines: list[tuple[float, str]] = []
        reader = threading.Thread(target=read_lines, args=(worker.stderr, spawned, lines), daemon=True)
        reader.start()
        try:
            result = client.result(job_id, timeout=900)
            first_job_s = time.monotonic() - spawned
            cpu_s = cpu_seconds(worker.pid)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(60)
            reader.join(10)
    if result.status != "done":
        raise RuntimeError(f"the job ended {result.status}: {result.error}")
    return Start(kind, first_job_s, cpu_s, [(at, text) for at, text in lines if at <= first_job_s + 0.5])


def read_lines(stream, spawned: float, into: list[tuple[float, str]]) -> None:
    for line in stream:
        match = RECORD.match(line.rstrip("\n"))
        into.append((time.monotonic() - spawned, match["text"] if match else line.rstrip("\n")))


if __name__ == "__main__":
    main()
