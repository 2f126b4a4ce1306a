"""What one round trip costs the caller's CPU after the server has been left idle (issue 43: why
bench/peers.py's submit column read 128-143 us where the same submits, one right after another in
a process of their own, read 81-92). One process, one fresh redis-server over TCP on loopback, no
worker: a redis-py PING, a MILI `submit` (bench/peers.py's job) and a piece of pure Python work
of about a submit's size (JSON), each `--calls` times right after one another, then each after a
2 ms pause (a sleep, or a spin that keeps this thread on its CPU), in turn; this thread's CPU per
call (time.thread_time, the pause left out).

    python -m bench.round_trip_gap [--calls 1000 --rounds 2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from collections.abc import Callable

import redis

from producer_client import Client
from worker.embedded_redis import EmbeddedRedis, free_port

PAUSE_S = 0.002
DOCUMENT = {"a": list(range(200)), "b": {str(i): i for i in range(100)}}


def spin() -> None:
    end = time.perf_counter() + PAUSE_S
    while time.perf_counter() < end:
        pass


PAUSES: dict[str, Callable[[], None] | None] = {
    "none": None,
    "sleep 2 ms": lambda: time.sleep(PAUSE_S),
    "spin 2 ms": spin,
}


def cpu_per_call(call: Callable[[], object], pause: Callable[[], None] | None, calls: int) -> float:
    total = 0.0
    for _ in range(calls):
        if pause is not None:
            pause()
        start = time.thread_time()
        call()
        total += time.thread_time() - start
    return total / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the start")
    with EmbeddedRedis(port=free_port()) as server:
        plain = redis.Redis.from_url(server.url)
        client = Client(server.url, "bench")
        prompts = (f"hello world, job 00-{i:06d}" for i in itertools.count())
        calls: dict[str, Callable[[], object]] = {
            "PING (redis-py)": plain.ping,
            "submit (MILI)": lambda: client.submit(next(prompts), max_tokens=1, temperature=0.0),
            "JSON, no I/O": lambda: [json.loads(json.dumps(DOCUMENT)) for _ in range(3)],
        }
        for call in calls.values():  # warm: connections, scripts, the interpreter's caches
            cpu_per_call(call, None, 100)
        print(f"\nCPU us per call (this thread), {args.calls} calls each; rounds side by side:\n")
        print(f"| call | {' | '.join(f'after {name}' for name in PAUSES)} |")
        print(f"|---|{'---|' * len(PAUSES)}")
        for name, call in calls.items():
            cells = [
                ", ".join(f"{cpu_per_call(call, pause, args.calls):.0f}" for _ in range(args.rounds))
                for pause in PAUSES.values()
            ]
            print(f"| {name} | {' | '.join(cells)} |")
        client.close()
        plain.close()
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
