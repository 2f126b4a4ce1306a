"""Load and soak: P producer processes submit M short jobs each to 2 worker processes (the echo
engine: no model, so the queue path is what is loaded) on one redis-server, and the run checks
what a queue must keep under load:

  - every job gets exactly one result, and the right one: lost, duplicated and wrong results are
    counted (all must be 0). A duplicate would show as a second entry in the job's done stream;
  - jobs/s and the end-to-end latency distribution (submit to result, as the producer sees it);
  - Redis memory before, at its peak during, and after the run: bounded, because acknowledged
    entries are deleted at once and each job's keys expire result_ttl_s after it ends.

Each producer keeps `--window` jobs in flight (threads, one client each) and checks every
result's text (the echo of its prompt) and its done stream's length.

    python -m bench.load [--producers 4 --jobs 2500 --window 4 --result-ttl-s 10 --tcp]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import threading
import time
from dataclasses import dataclass

import redis

from bench.measure import cpu_seconds, pct
from harness.processes import start_worker
from producer_client import Client, JobFailed
from producer_client.keys import Keys
from worker.embedded_redis import EmbeddedRedis, free_port

QUEUE = "load"
KEYS = Keys()


def main() -> None:
    args = parse_args()
    total = args.producers * args.jobs
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(
        f"load: {args.producers} producers x {args.jobs} jobs = {total} (window {args.window} each), "
        f"2 echo workers, result_ttl_s {args.result_ttl_s}\n"
    )
    ok = report(run_load(args), total)
    print("OK" if ok else "FAILED: results lost, duplicated or wrong")
    sys.exit(0 if ok else 1)


@dataclass
class Measured:
    """What one load run measured: the producers' outcome (run_producers), the run's time, the CPU
    seconds each worker and redis-server spent in it, the results the workers wrote, and Redis's
    memory (and queue depth) before, during and after it."""

    outcome: dict
    elapsed: float
    cpu: list[float]  # the two workers', then redis-server's
    written: int
    depth: int
    before_mib: float
    after_mib: float
    keys_after: int
    sampler: MemorySampler


def run_load(args: argparse.Namespace) -> Measured:
    """The load on a redis-server and two echo workers of its own, measured from an idle start."""
    server = EmbeddedRedis(port=free_port() if args.tcp else None)
    with server:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        ttl = ("--result-ttl-s", str(args.result_ttl_s))
        workers = [start_worker(server.url, QUEUE, *ttl, name=f"load-{n}") for n in range(2)]
        try:
            wait_ready(server.url)
            time.sleep(args.result_ttl_s + 1)  # the warm-up jobs' keys expire: the baseline is idle
            before = used_mib(admin)
            pids = [w.pid for w in workers] + [server.process.pid]
            cpu_before = [cpu_seconds(pid) for pid in pids]
            sampler = MemorySampler(admin)
            sampler.start()
            t0 = time.perf_counter()
            outcome = run_producers(server.url, args.producers, args.jobs, args.window)
            elapsed = time.perf_counter() - t0
            sampler.stop()
            cpu = [cpu_seconds(pid) - c for pid, c in zip(pids, cpu_before)]
            written = sum(jobs_written(admin, w) for w in ("load-0", "load-1"))
            depth = admin.xlen(KEYS.queue(QUEUE))
            time.sleep(args.result_ttl_s + 2)  # every job's keys expire
            after, keys_after = used_mib(admin), admin.dbsize()
        finally:
            for w in workers:
                w.terminate()
                w.wait(timeout=30)
        admin.close()
    return Measured(outcome, elapsed, cpu, written, depth, before, after, keys_after, sampler)


def report(m: Measured, total: int) -> bool:
    """Prints what the run measured; whether every job got exactly one result, the right one."""
    outcome, cpu, elapsed = m.outcome, m.cpu, m.elapsed
    lat = sorted(outcome["latencies"])
    print(f"jobs: {len(lat)} completed in {elapsed:.2f}s: {len(lat) / elapsed:,.0f} jobs/s")
    print(
        f"CPU per job: workers {(cpu[0] + cpu[1]) / total * 1e6:.0f} us, redis-server {cpu[2] / total * 1e6:.0f} us, "
        f"producers {outcome['cpu'] / total * 1e6:.0f} us (load average {os.getloadavg()[0]:.2f} at end)"
    )
    print(
        "latency (submit to result): "
        + ", ".join(f"p{q} {pct(lat, q) * 1e3:.1f} ms" for q in (50, 90, 99, 99.9))
        + f", max {lat[-1] * 1e3:.1f} ms"
    )
    print(
        f"results: lost {outcome['lost']}, duplicated {outcome['duplicated']}, wrong {outcome['wrong']}; "
        f"results written by the workers {m.written} (jobs {total} + warm-up {WARM_UP})"
    )
    print(
        f"redis memory: before {m.before_mib:.2f} MiB, peak during {m.sampler.peak_mib:.2f} MiB "
        f"(queue stream at most {m.sampler.peak_depth} entries), after {m.after_mib:.2f} MiB ({m.keys_after} keys); "
        f"queue stream after the run: {m.depth} entries"
    )
    print("redis memory during the run, each second (MiB): " + " ".join(f"{x:.0f}" for x in m.sampler.per_second()))
    for example in outcome["examples"]:
        print(f"  {example}")
    return outcome["lost"] == outcome["duplicated"] == outcome["wrong"] == 0 and m.written == total + WARM_UP


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--producers", type=int, default=4, help="producer processes")
    p.add_argument("--jobs", type=int, default=2500, help="jobs per producer")
    p.add_argument("--window", type=int, default=4, help="jobs each producer keeps in flight")
    p.add_argument("--result-ttl-s", type=int, default=10, help="the workers' result_ttl_s: how long job keys stay")
    p.add_argument("--tcp", action="store_true", help="Redis over TCP on 127.0.0.1 instead of a unix socket")
    return p.parse_args()


WARM_UP = 20


def wait_ready(url: str) -> None:
    with Client(url, QUEUE) as client:
        for i in range(WARM_UP):  # both workers up, their connections and the scripts loaded
            client.generate(f"warm {i}", max_tokens=16, timeout=120)


def jobs_written(admin: redis.Redis, worker: str) -> int:
    """Results a worker wrote (its mili_jobs_total over outcomes), from its metrics endpoint."""
    import urllib.request

    port = admin.hget(KEYS.worker(worker), "metrics_port")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return int(sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("mili_jobs_total{")))


class MemorySampler:
    """Redis's used_memory and the queue stream's length, every 0.1 s, in a thread."""

    def __init__(self, admin: redis.Redis):
        self.admin = admin
        self.samples: list[float] = []  # MiB
        self.peak_depth = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.done.set()
        self.thread.join()

    def _sample(self) -> None:
        while not self.done.wait(0.1):
            try:
                self.samples.append(used_mib(self.admin))
                self.peak_depth = max(self.peak_depth, self.admin.xlen(KEYS.queue(QUEUE)))
            except redis.RedisError as e:  # a slow reply under load must not end the sampling
                print(f"memory sample skipped: {e}", file=sys.stderr)

    @property
    def peak_mib(self) -> float:
        return max(self.samples, default=0.0)

    def per_second(self) -> list[float]:
        return self.samples[9::10]


def used_mib(admin: redis.Redis) -> float:
    return admin.info("memory")["used_memory"] / 2**20


def run_producers(url: str, producers: int, jobs: int, window: int) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Event()
    children = [ctx.Process(target=producer, args=(url, p, jobs, window, go, results)) for p in range(producers)]
    for c in children:
        c.start()
    assert all(results.get() == "ready" for _ in children)
    go.set()
    parts = [results.get() for _ in children]
    for c in children:
        c.join()
    return {
        "latencies": [x for p in parts for x in p["latencies"]],
        **{k: sum(p[k] for p in parts) for k in ("lost", "duplicated", "wrong", "cpu")},
        "examples": [x for p in parts for x in p["examples"]][:5],
    }


def producer(url: str, index: int, jobs: int, window: int, go, results) -> None:
    clients = [Client(url, QUEUE) for _ in range(window)]
    for c in clients:
        c.redis.ping()
    out = {"latencies": [], "lost": 0, "duplicated": 0, "wrong": 0, "examples": []}
    lock = threading.Lock()
    results.put("ready")
    go.wait()
    cpu0 = time.process_time()

    def produce(client: Client, slot: int) -> None:
        for n in range(slot, jobs, window):
            prompt = f"{index}.{n}"  # unique, and its echo is the whole output: 3 to 6 tokens
            start = time.perf_counter()
            try:
                result = client.generate(prompt, max_tokens=8, timeout=60)
                latency = time.perf_counter() - start
                copies = client.redis.xlen(KEYS.done(result.id))
            except JobFailed as e:
                with lock:
                    out["wrong"] += 1
                    out["examples"].append(f"{prompt!r}: failed, {e.code}: {e.message}")
                continue
            except Exception as e:  # no result: JobTimeout, or the connection lost for good
                with lock:
                    out["lost"] += 1
                    out["examples"].append(f"{prompt!r}: {e!r}")
                continue
            with lock:
                out["latencies"].append(latency)
                out["duplicated"] += max(0, copies - 1)
                if result.text != prompt or result.status != "done":
                    out["wrong"] += 1
                    out["examples"].append(f"{prompt!r}: {result.status} {result.text!r}")

    threads = [threading.Thread(target=produce, args=(c, slot)) for slot, c in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out["cpu"] = time.process_time() - cpu0
    results.put(out)


if __name__ == "__main__":
    main()
