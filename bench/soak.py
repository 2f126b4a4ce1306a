"""A million results kept (issue 43 item 5): `--jobs` 16-token jobs through two echo workers on one
redis-server, every result kept (result_ttl_s an hour), then Redis's memory and every result read
back and checked.

A producer submits the jobs with submit_many in chunks, keeping at most `--window` chunks
unfinished (the queue's depth bound is 10,000 jobs), and collects each chunk's results as they
come (each checked: status done, 16 tokens, the text its prompt makes: the echo engine's output is
its prompt's first bytes, and each prompt starts with the job's number). Once every job has ended
and the short-lived `done` streams have expired (DONE_TTL_MS), it reads Redis's `used_memory`
(minus the clients' buffers) and reads every job's result again, in chunks, from the kept hashes.

    python -m bench.soak [--jobs 1000000 --chunk 2000 --window 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections import deque
from pathlib import Path

import redis
from tqdm import tqdm

from harness.processes import start_worker
from producer_client import Client
from producer_client.keys import DONE_TTL_MS
from worker.embedded_redis import EmbeddedRedis

QUEUE = "soak"
TOKENS = 16
TARGET_BYTES = 10**9  # issue 43: 1,000,000 kept jobs in <= 1 GB (the stricter reading: 10^9 bytes)
RESULT_TTL_S = 3600


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=1_000_000)
    parser.add_argument("--chunk", type=int, default=2000, help="jobs per submit_many")
    parser.add_argument("--window", type=int, default=3, help="chunks submitted and not yet collected")
    return parser.parse_args()


def prompt(n: int) -> str:
    return f"{n:09d}-abcdefghijklmnopqrstuvwxyz"


def expected_text(n: int) -> str:
    return prompt(n)[:TOKENS]


def main() -> None:
    args = parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at the start")
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="mili-soak-") as logs:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        ttl = ("--result-ttl-s", str(RESULT_TTL_S))
        workers = [
            start_worker(server.url, QUEUE, *ttl, name=f"soak-{i}", log_path=Path(logs) / f"soak-{i}.log")
            for i in range(2)
        ]
        try:
            with Client(server.url, QUEUE) as client:
                client.generate("warm up", max_tokens=1, timeout=120)
                base = kept_bytes(admin)
                start = time.perf_counter()
                ids = run_jobs(client, args)
                elapsed = time.perf_counter() - start
                time.sleep(DONE_TTL_MS / 1000 + 2)  # the done streams have gone: what is left is kept
                used = kept_bytes(admin) - base
                read_start = time.perf_counter()
                bad = read_back(client, ids, args.chunk)
                read_s = time.perf_counter() - read_start
        finally:
            for worker in workers:
                worker.terminate()
            for worker in workers:
                worker.wait(30)
        report(args.jobs, elapsed, used, admin.dbsize(), bad, read_s)


def kept_bytes(admin: redis.Redis) -> int:
    """Redis's used_memory less its clients' buffers (which come and go with the readers)."""
    memory = admin.info("memory")
    return int(memory["used_memory"]) - int(memory.get("mem_clients_normal", 0))


def run_jobs(client: Client, args: argparse.Namespace) -> list[str]:
    """Submit every job, at most `window` chunks unfinished; check each chunk's results."""
    ids: list[str] = []
    open_chunks: deque[tuple[int, list[str]]] = deque()
    with tqdm(total=args.jobs, unit="job", desc="jobs ended") as bar:
        for first in range(0, args.jobs, args.chunk):
            count = min(args.chunk, args.jobs - first)
            chunk = client.submit_many([{"prompt": prompt(first + i), "max_tokens": TOKENS} for i in range(count)])
            ids += chunk
            open_chunks.append((first, chunk))
            if len(open_chunks) > args.window:
                bar.update(collect(client, *open_chunks.popleft()))
        while open_chunks:
            bar.update(collect(client, *open_chunks.popleft()))
    return ids


def collect(client: Client, first: int, chunk: list[str]) -> int:
    results = client.results(chunk, timeout=600)
    bad = sum(not right(result, first + i) for i, result in enumerate(results))
    if bad:
        raise SystemExit(f"{bad} wrong results in the chunk from job {first}")
    return len(chunk)


def right(result, n: int) -> bool:
    return result.status == "done" and len(result.token_ids) == TOKENS and result.text == expected_text(n)


def read_back(client: Client, ids: list[str], chunk: int) -> int:
    """Every kept result read again from Redis and checked; the number of wrong or missing ones."""
    bad = 0
    for first in tqdm(range(0, len(ids), chunk), unit="chunk", desc="results read back"):
        results = client.results(ids[first : first + chunk], timeout=60)
        bad += sum(not right(result, first + i) for i, result in enumerate(results))
    return bad


def report(jobs: int, elapsed: float, used: int, keys: int, bad: int, read_s: float) -> None:
    print(f"{jobs:,} jobs in {elapsed:.0f} s ({jobs / elapsed:,.0f} jobs/s end to end); {keys:,} keys kept")
    print(f"Redis used_memory for the kept jobs: {used / 2**20:,.1f} MiB, {used / jobs:,.0f} bytes a job")
    print(f"every result read back in {read_s:.0f} s: {jobs - bad:,} right, {bad} wrong or missing")
    met = used * 1_000_000 / jobs <= TARGET_BYTES and bad == 0
    scaled = used * 1_000_000 / jobs
    print(f"target: 1,000,000 kept jobs in <= 1 GB ({scaled / 1e9:.3f} GB for a million): {'met' if met else 'MISSED'}")


if __name__ == "__main__":
    main()
