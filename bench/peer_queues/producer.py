"""The producer side of bench/peers.py, the same for every library. Run in the library's own
environment as `python -m bench.peer_queues.producer APP MODE ...`, it drives APP's Producer and
talks to bench/peers.py in lines: it prints {"ready": true} once connected and warmed up, starts
at the next line on stdin, prints its figures as one JSON line, and closes its connections at the
line after that (so that Redis's memory is read with the same clients connected before and after).

  submit: `--jobs` submits one after another, with no worker running: wall and CPU time per
          submit (the process's: every thread's, its collections included), in CHUNKS parts whose
          lowest and highest CPU per submit show how steady the figure was, and the context
          switches per submit (voluntary: it slept for the reply; involuntary: redis-server, woken
          on its core, ran first); then the function calls of one submit (cProfile: all calls,
          and calls of Python functions alone), the median of PROFILED submits.
  count:  `--jobs` submits one after another, with no worker running, and nothing else: for a
          count of the process's instructions (bench/peers.py zeroes callgrind's at the go and
          dumps them at its {"submits": N} line).
  load:   `--producers` producers (threads, or asyncio tasks for an async library: each library
          as it is documented), each submitting a job and reading its result before the next, for
          `--seconds` or `--jobs` each: by the app's `run` where the library documents one call for
          both (MILI's `generate`), else its `submit` then its `result`; with `--direct N`, also N
          jobs run in-process (the no-op baseline of the added latency)."""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import importlib
import inspect
import itertools
import json
import pstats
import resource
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

WARMUP_JOBS = 5  # per producer: connections opened, scripts loaded, the workers' first jobs done
PROFILED = 21
CHUNKS = 10  # parts of the timed submits, each timed alone: the figure's spread within a run


def main() -> None:
    args = parse_args()
    app = importlib.import_module(f"bench.peer_queues.{args.app}_app")
    if inspect.iscoroutinefunction(app.Producer.submit):
        asyncio.run(run_async(app, args))
    else:
        run_sync(app, args)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("app", help="a module bench.peer_queues.<app>_app")
    p.add_argument("mode", choices=("submit", "count", "load"))
    p.add_argument("--producers", type=int, default=1)
    p.add_argument("--jobs", type=int, help="submits (submit), or jobs per producer (load)")
    p.add_argument("--seconds", type=float, help="how long each producer runs (load)")
    p.add_argument("--direct", type=int, default=0, help="jobs to run in-process after the load")
    return p.parse_args()


def say(message: dict) -> None:
    print(json.dumps(message), flush=True)


def next_line() -> None:
    """The next line from bench/peers.py; its end (it stopped) ends this producer."""
    if not sys.stdin.readline():
        sys.exit("bench/peers.py went away")


def prompts(producer: int) -> Iterator[str]:
    """Distinct arguments: MILI places a job by its prompt, and identical ones would all go to one worker."""
    return (f"hello world, job {producer:02d}-{i:06d}" for i in itertools.count())


def run_sync(app, args: argparse.Namespace) -> None:
    producers = [app.Producer() for _ in range(args.producers)]
    feeds = [prompts(i) for i in range(args.producers)]
    try:
        for producer, feed in zip(producers, feeds):
            for prompt in itertools.islice(feed, WARMUP_JOBS):
                handle = producer.submit(prompt)
                if args.mode == "load":
                    producer.result(handle)
        say({"ready": True})
        next_line()
        if args.mode == "submit":
            say(submit_figures(lambda: producers[0].submit(next(feeds[0])), args.jobs))
        elif args.mode == "count":
            for prompt in itertools.islice(feeds[0], args.jobs):
                producers[0].submit(prompt)
            say({"submits": args.jobs})
        else:
            say(load_sync(producers, feeds, args) | direct_figures(app, args.direct))
        next_line()
    finally:
        for producer in producers:
            producer.close()


def submit_figures(submit: Callable[[], object], jobs: int) -> dict:
    chunks = [timed_chunk(submit, part) for part in chunk_sizes(jobs)]
    counts = []
    for _ in range(PROFILED):
        profile = cProfile.Profile()
        profile.enable()
        submit()
        profile.disable()
        counts.append(call_counts(profile))
    return submit_summary(chunks, counts)


def chunk_sizes(jobs: int) -> list[int]:
    """`jobs` split into up to CHUNKS parts, as even as can be."""
    parts = min(CHUNKS, jobs)
    return [jobs // parts + (i < jobs % parts) for i in range(parts)]


def timed_chunk(submit: Callable[[], object], jobs: int) -> Chunk:
    clock = ChunkClock()
    for _ in range(jobs):
        submit()
    return clock.chunk(jobs)


class Chunk(NamedTuple):
    """One part of the timed submits: its CPU and wall seconds, and the process's context switches."""

    jobs: int
    cpu_s: float
    wall_s: float
    slept: int  # voluntary switches: waits for a reply
    preempted: int  # involuntary switches


class ChunkClock:
    """The process's CPU, wall time and context switches from its making to `chunk`."""

    def __init__(self) -> None:
        self.usage, self.cpu, self.wall = (
            resource.getrusage(resource.RUSAGE_SELF),
            time.process_time(),
            time.perf_counter(),
        )

    def chunk(self, jobs: int) -> Chunk:
        cpu, wall, usage = time.process_time(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        slept, preempted = usage.ru_nvcsw - self.usage.ru_nvcsw, usage.ru_nivcsw - self.usage.ru_nivcsw
        return Chunk(jobs, cpu - self.cpu, wall - self.wall, slept, preempted)


def call_counts(profile: cProfile.Profile) -> tuple[int, int]:
    """All calls, and calls of Python functions alone (cProfile names a C function's file '~')."""
    stats = pstats.Stats(profile)
    python = sum(entry[1] for (file, _, _), entry in stats.stats.items() if file != "~")
    return stats.total_calls, python


def submit_summary(chunks: list[Chunk], counts: list[tuple[int, int]]) -> dict:
    """Per submit over all the timed submits (every cost in any part counts), and the lowest and
    highest CPU of a part."""
    jobs = sum(c.jobs for c in chunks)
    per_chunk = [c.cpu_s / c.jobs * 1e6 for c in chunks]
    return {
        "submit_wall_us": sum(c.wall_s for c in chunks) / jobs * 1e6,
        "submit_cpu_us": sum(c.cpu_s for c in chunks) / jobs * 1e6,
        "submit_cpu_low_us": min(per_chunk),
        "submit_cpu_high_us": max(per_chunk),
        "submit_slept": sum(c.slept for c in chunks) / jobs,
        "submit_preempted": sum(c.preempted for c in chunks) / jobs,
        "submit_calls": statistics.median(c[0] for c in counts),
        "submit_python_calls": statistics.median(c[1] for c in counts),
    }


def load_sync(producers: list, feeds: list[Iterator[str]], args: argparse.Namespace) -> dict:
    latencies: list[list[float]] = [[] for _ in producers]
    cpu, start = time.process_time(), time.perf_counter()
    end = None if args.seconds is None else start + args.seconds
    threads = [
        threading.Thread(target=produce_sync, args=(p, feed, args.jobs, end, out))
        for p, feed, out in zip(producers, feeds, latencies)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return load_summary(latencies, time.perf_counter() - start, time.process_time() - cpu)


def produce_sync(producer, feed: Iterator[str], jobs: int | None, end: float | None, out: list[float]) -> None:
    run = getattr(producer, "run", None) or (lambda prompt: producer.result(producer.submit(prompt)))
    while (jobs is None or len(out) < jobs) and (end is None or time.perf_counter() < end):
        start = time.perf_counter()
        run(next(feed))
        out.append(time.perf_counter() - start)


def load_summary(latencies: list[list[float]], elapsed: float, cpu: float) -> dict:
    flat = [x for out in latencies for x in out]
    return {"jobs": len(flat), "elapsed_s": elapsed, "cpu_s": cpu, **percentiles("latency", flat)}


def percentiles(name: str, values: list[float]) -> dict:
    ordered = sorted(values)
    return {f"{name}_p{q}": ordered[min(len(ordered) - 1, len(ordered) * q // 100)] for q in (50, 99)}


def direct_figures(app, jobs: int) -> dict:
    if not jobs:
        return {}
    run = app.direct()
    feed = prompts(99)
    times = []
    for _ in range(jobs):
        prompt = next(feed)
        start = time.perf_counter()
        run(prompt)
        times.append(time.perf_counter() - start)
    return percentiles("direct", times)


async def run_async(app, args: argparse.Namespace) -> None:
    producer = app.Producer()
    await producer.start()
    feeds = [prompts(i) for i in range(args.producers)]
    try:
        for feed in feeds:
            for prompt in itertools.islice(feed, WARMUP_JOBS):
                handle = await producer.submit(prompt)
                if args.mode == "load":
                    await producer.result(handle)
        say({"ready": True})
        await asyncio.to_thread(next_line)
        if args.mode == "submit":
            say(await submit_figures_async(producer, feeds[0], args.jobs))
        elif args.mode == "count":
            for prompt in itertools.islice(feeds[0], args.jobs):
                await producer.submit(prompt)
            say({"submits": args.jobs})
        else:
            say(await load_async(producer, feeds, args) | direct_figures(app, args.direct))
        await asyncio.to_thread(next_line)
    finally:
        await producer.close()


async def submit_figures_async(producer, feed: Iterator[str], jobs: int) -> dict:
    chunks = []
    for part in chunk_sizes(jobs):
        clock = ChunkClock()
        for _ in range(part):
            await producer.submit(next(feed))
        chunks.append(clock.chunk(part))
    counts = []
    for _ in range(PROFILED):
        profile = cProfile.Profile()
        profile.enable()
        await producer.submit(next(feed))
        profile.disable()
        counts.append(call_counts(profile))
    return submit_summary(chunks, counts)


async def load_async(producer, feeds: list[Iterator[str]], args: argparse.Namespace) -> dict:
    latencies: list[list[float]] = [[] for _ in feeds]
    cpu, start = time.process_time(), time.perf_counter()
    end = None if args.seconds is None else start + args.seconds
    await asyncio.gather(*(produce_async(producer, feed, args.jobs, end, out) for feed, out in zip(feeds, latencies)))
    return load_summary(latencies, time.perf_counter() - start, time.process_time() - cpu)


async def produce_async(producer, feed: Iterator[str], jobs: int | None, end: float | None, out: list[float]) -> None:
    run = getattr(producer, "run", None)
    while (jobs is None or len(out) < jobs) and (end is None or time.perf_counter() < end):
        start = time.perf_counter()
        if run is None:
            await producer.result(await producer.submit(next(feed)))
        else:
            await run(next(feed))
        out.append(time.perf_counter() - start)


if __name__ == "__main__":
    main()
