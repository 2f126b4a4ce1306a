"""Queue benchmark: what the Redis queue path costs, with the model taken out.

One worker process runs the echo engine (`--model echo`: no model; a job's output is its
prompt, one token per step) on an embedded redis-server; producer processes send short jobs
through the real client (`Client.generate`: submit, then block on the job's events). In one
run it prints:

  1. the same engine called directly (tokenize, add_request, step until finished): per-job latency;
  2. latency through the queue at moderate load (a few producers, each waiting for its
     result before sending the next), and what the queue path adds to (1);
  3. throughput at saturation: jobs/s with many concurrent producers, and the CPU time per
     job of each process (worker, redis-server, producers).

With --bulk it measures Client.submit_many and as_completed instead, each beside the same jobs
sent one at a time (submit(), then wait() for each) in the same run:

  1. submission alone, no worker running: jobs/s enqueued;
  2. end to end with two echo workers: jobs/s from the first submit to the last result, and
     the CPU time per job of each process.

With --redis URL it measures throughput at saturation (as in 3) on that deployment, with one queue
and with three queues (on a cluster, each on a master of its own: a queue lives on one shard),
beside an embedded redis-server over TCP with one queue and with three, in the same run, with
three echo workers in each case (with three queues, one each). `--redis local-cluster` starts a
six-node cluster on this machine (harness/redis_servers.py) and measures that.

With --tenant NAME the producers submit as that tenant: every job goes through the tenant's
default-lane stream (ENQUEUE_LANES, the lanes' READ, the fair shares' counters) instead of the
queue's own stream, which a producer that names no tenant still uses.

    python -m bench.queue_path [--procs 4 --threads 4 --seconds 10 --max-tokens 1 --tcp --tenant NAME]
    python -m bench.queue_path --bulk [--jobs 100000 --one-at-a-time-jobs 10000 --tcp]
    python -m bench.queue_path --redis redis+cluster://h:p,h:p [--procs 4 --threads 4 --seconds 10]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.measure import cpu_seconds, pct
from harness.processes import start_worker
from producer_client import Client  # (the producers import nothing heavier)
from worker.embedded_redis import EmbeddedRedis, free_port

PROMPT = "hello world"
QUEUE = "bench"


def main() -> None:
    args = parse_args()
    if args.bulk:
        return bulk_main(args)
    if args.redis:
        return modes_main(args)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(f"jobs: prompt {PROMPT!r}, max_tokens {args.max_tokens}, greedy; 1 worker, echo engine\n")
    direct = direct_latencies(args.latency_jobs, args.max_tokens)
    report("direct engine call", direct)
    server = EmbeddedRedis(port=free_port() if args.tcp else None)
    with server:
        print(f"redis-server: {server.url}")
        worker = start_worker(server.url, QUEUE, name="bench-worker")
        try:
            wait_ready(server.url, args.max_tokens)
            queued = run_producers(
                server.url, 1, args.latency_producers, args.latency_jobs, None, args.max_tokens, tenant=args.tenant
            )
            report(f"through the queue, {args.latency_producers} producers (moderate load)", queued["latencies"])
            for q in (50, 99):
                print(f"  added by the queue path, p{q}: {(pct(queued['latencies'], q) - pct(direct, q)) * 1e3:.3f} ms")
            before = cpu_seconds(worker.pid), cpu_seconds(server.process.pid)
            t0 = time.perf_counter()
            loaded = run_producers(
                server.url, args.procs, args.threads, None, args.seconds, args.max_tokens, tenant=args.tenant
            )
            wall = time.perf_counter() - t0
            after = cpu_seconds(worker.pid), cpu_seconds(server.process.pid)
        finally:
            worker.terminate()
            worker.wait(timeout=30)
    n = len(loaded["latencies"])
    print(f"\nsaturation: {args.procs} processes x {args.threads} producers for {args.seconds:g}s")
    print(f"  throughput: {n / loaded['elapsed']:.0f} jobs/s end to end ({n} jobs)")
    report("  latency under saturation", loaded["latencies"])
    print(
        f"  CPU per job: worker {(after[0] - before[0]) / n * 1e6:.0f} us, redis-server "
        f"{(after[1] - before[1]) / n * 1e6:.0f} us, producers {loaded['cpu'] / n * 1e6:.0f} us "
        f"(wall {wall:.1f}s, load average {os.getloadavg()[0]:.2f} at end)"
    )


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=4, help="producer processes at saturation")
    p.add_argument("--threads", type=int, default=4, help="producers (threads, one client each) per process")
    p.add_argument("--seconds", type=float, default=10.0, help="length of the saturation run")
    p.add_argument("--latency-producers", type=int, default=2)
    p.add_argument("--latency-jobs", type=int, default=4000)
    p.add_argument("--max-tokens", type=int, default=1)
    p.add_argument("--tcp", action="store_true", help="Redis over TCP on 127.0.0.1 instead of a unix socket")
    p.add_argument("--tenant", help="the producers' tenant: their jobs go through its lane stream")
    p.add_argument("--bulk", action="store_true", help="measure submit_many and as_completed instead")
    p.add_argument("--jobs", type=int, default=100_000, help="jobs per bulk measurement")
    p.add_argument("--one-at-a-time-jobs", type=int, default=10_000, help="jobs per one-at-a-time measurement")
    p.add_argument(
        "--redis", help="a deployment's URL (or local-cluster) to measure with 1 and 3 queues beside one server"
    )
    return p.parse_args()


def direct_latencies(jobs: int, max_tokens: int) -> list[float]:
    from producer_client import SamplingParams
    from worker.engine.echo import EchoEngine
    from worker.engine.settings import EngineSettings

    engine = EchoEngine(EngineSettings())
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    latencies = []
    for i in range(jobs):
        t0 = time.perf_counter()
        engine.add_request(str(i), engine.tokenizer.encode(PROMPT), params)
        while not any(out.finished for out in engine.step()):
            pass
        latencies.append(time.perf_counter() - t0)
    return latencies


def wait_ready(url: str, max_tokens: int, queue: str = QUEUE) -> None:
    with Client(url, queue) as client:
        for _ in range(200):  # warm up the worker, its connection and the scripts
            client.generate(PROMPT, max_tokens=max_tokens, temperature=0.0, timeout=120)


def run_producers(
    url: str,
    procs: int,
    threads: int,
    jobs: int | None,
    seconds: float | None,
    max_tokens: int,
    queues: tuple[str, ...] = (QUEUE,),
    tenant: str | None = None,
) -> dict:
    """Each producer sends one job at a time and waits for its result, for `jobs` jobs in
    all or for `seconds`; the producers take `queues` in turn, as `tenant`. Returns all
    latencies, the elapsed time and the producers' CPU."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Event()
    per_thread = None if jobs is None else jobs // (procs * threads)
    children = [
        ctx.Process(
            target=producer_process,
            args=(url, threads, per_thread, seconds, max_tokens, go, results, queues, p, tenant),
        )
        for p in range(procs)
    ]
    for c in children:
        c.start()
    ready = [results.get() for _ in children]  # each says when its clients are connected
    assert all(r == "ready" for r in ready)
    t0 = time.perf_counter()
    go.set()
    parts = [results.get() for _ in children]
    elapsed = time.perf_counter() - t0
    for c in children:
        c.join()
    return {
        "latencies": [x for p in parts for x in p["latencies"]],
        "elapsed": max(p["elapsed"] for p in parts) if seconds else elapsed,
        "cpu": sum(p["cpu"] for p in parts),
    }


def producer_process(
    url, threads, jobs, seconds, max_tokens, go, results, queues=(QUEUE,), first=0, tenant=None
) -> None:
    clients = [Client(url, queues[(first * threads + t) % len(queues)], tenant=tenant) for t in range(threads)]
    for c in clients:
        c.generate(PROMPT, max_tokens=max_tokens, temperature=0.0, timeout=120)  # connect, load scripts
    latencies: list[list[float]] = [[] for _ in clients]
    results.put("ready")
    go.wait()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    end = None if seconds is None else t0 + seconds

    def produce(client: Client, out: list[float]) -> None:
        while (jobs is None or len(out) < jobs) and (end is None or time.perf_counter() < end):
            start = time.perf_counter()
            client.generate(PROMPT, max_tokens=max_tokens, temperature=0.0, timeout=120)
            out.append(time.perf_counter() - start)

    workers = [threading.Thread(target=produce, args=(c, out)) for c, out in zip(clients, latencies)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - t0
    results.put(
        {"latencies": [x for out in latencies for x in out], "elapsed": elapsed, "cpu": time.process_time() - cpu0}
    )


def bulk_main(args: argparse.Namespace) -> None:
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(f"jobs: prompt {PROMPT!r}, max_tokens {args.max_tokens}, greedy; no bound on the queue's depth\n")
    with (
        EmbeddedRedis(port=free_port() if args.tcp else None) as server,
        Client(server.url, QUEUE, max_queue_depth=None) as client,
    ):
        print(f"redis-server: {server.url}")
        spec = {"prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0.0}
        one = rate(args.one_at_a_time_jobs, lambda: [client.submit(**spec) for _ in range(args.one_at_a_time_jobs)])
        many = rate(args.jobs, lambda: client.submit_many([spec] * args.jobs))
        print(
            f"submission, no worker: one at a time {one:,.0f} jobs/s ({args.one_at_a_time_jobs:,} jobs), "
            f"submit_many {many:,.0f} jobs/s ({args.jobs:,} jobs): {many / one:.1f}x"
        )
        client.redis.flushdb()  # the workers must not start on those
        workers = [start_worker(server.url, QUEUE, name=f"bench-worker-{i}") for i in range(2)]
        try:
            wait_ready(server.url, args.max_tokens)
            one = rate(args.one_at_a_time_jobs, lambda: one_at_a_time(client, spec, args.one_at_a_time_jobs))
            before = [cpu_seconds(w.pid) for w in workers], cpu_seconds(server.process.pid), time.process_time()
            many = rate(args.jobs, lambda: in_bulk(client, spec, args.jobs))
            after = [cpu_seconds(w.pid) for w in workers], cpu_seconds(server.process.pid), time.process_time()
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(timeout=30)
    print(
        f"end to end, 2 echo workers: one at a time (submit, then wait for each) {one:,.0f} jobs/s, "
        f"submit_many + as_completed {many:,.0f} jobs/s: {many / one:.1f}x"
    )
    per_job = [(a - b) / args.jobs * 1e6 for a, b in zip(after[0], before[0])]
    print(
        f"  CPU per job in bulk: workers {' + '.join(f'{us:.0f}' for us in per_job)} us, redis-server "
        f"{(after[1] - before[1]) / args.jobs * 1e6:.0f} us, producer {(after[2] - before[2]) / args.jobs * 1e6:.0f} us "
        f"(load average {os.getloadavg()[0]:.2f} at end)"
    )


def modes_main(args: argparse.Namespace) -> None:
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(
        f"jobs: prompt {PROMPT!r}, max_tokens {args.max_tokens}, greedy; 3 echo workers; "
        f"{args.procs} processes x {args.threads} producers for {args.seconds:g}s each\n"
    )
    with EmbeddedRedis(port=free_port()) as server:
        single = {n: saturation(server.url, queues_on_shards(server.url, n), args) for n in (1, 3)}
    with deployment(args.redis) as url:
        spread = {n: saturation(url, queues_on_shards(url, n), args) for n in (1, 3)}
    print(f"\n{'':24}{'1 queue':>14}{'3 queues':>14}")
    print(f"{'one server (TCP)':24}" + "".join(f"{single[n]:>9,.0f} j/s" for n in (1, 3)))
    print(f"{'deployment':24}" + "".join(f"{spread[n]:>9,.0f} j/s" for n in (1, 3)))
    print(f"{'deployment / one server':24}" + "".join(f"{spread[n] / single[n]:>13.2f}x" for n in (1, 3)))
    print(f"(load average {os.getloadavg()[0]:.2f} at end)")


@contextmanager
def deployment(url: str) -> Iterator[str]:
    """The URL to measure: `local-cluster` starts a six-node cluster here for the run."""
    if url != "local-cluster":
        yield url
        return
    from harness.redis_servers import LocalCluster

    with tempfile.TemporaryDirectory(prefix="mili-bench-cluster-") as root, LocalCluster(Path(root)) as cluster:
        yield cluster.url


def queues_on_shards(url: str, n: int) -> tuple[str, ...]:
    """`n` queue names, each on a master of its own while there are masters enough (a cluster's
    queue lives on the shard of its hash tag); on one server, any `n` names."""
    from producer_client.cluster import is_cluster

    names = [f"{QUEUE}-{i}" for i in range(2000)]
    with Client(url, QUEUE) as client:
        if not is_cluster(client.redis):
            return tuple(names[:n])
        by_node: dict[str, str] = {}
        for name in names:
            by_node.setdefault(client.redis.get_node_from_key(client.keys.queue(name)).name, name)
        return tuple(list(by_node.values())[:n])


def saturation(url: str, queues: tuple[str, ...], args: argparse.Namespace) -> float:
    """Jobs/s end to end with 3 echo workers spread over `queues`, the producers over them too."""
    workers = [
        start_worker(url, queues[i % len(queues)], name=f"bench-worker-{queues[i % len(queues)]}-{i}") for i in range(3)
    ]
    try:
        for queue in queues:
            wait_ready(url, args.max_tokens, queue)
        before = sum(cpu_seconds(w.pid) for w in workers)
        loaded = run_producers(url, args.procs, args.threads, None, args.seconds, args.max_tokens, queues)
        workers_cpu = sum(cpu_seconds(w.pid) for w in workers) - before
    finally:
        for w in workers:
            w.terminate()
        for w in workers:
            w.wait(timeout=30)
    n = len(loaded["latencies"])
    print(
        f"{url.split('://')[0]}, {len(queues)} queue(s): {n / loaded['elapsed']:,.0f} jobs/s, p50 "
        f"{pct(loaded['latencies'], 50) * 1e3:.1f} ms, p99 {pct(loaded['latencies'], 99) * 1e3:.1f} ms; CPU per job: "
        f"workers {workers_cpu / n * 1e6:.0f} us, producers {loaded['cpu'] / n * 1e6:.0f} us"
    )
    return n / loaded["elapsed"]


def rate(jobs: int, run) -> float:
    t0 = time.perf_counter()
    run()
    return jobs / (time.perf_counter() - t0)


def one_at_a_time(client: Client, spec: dict, jobs: int) -> None:
    for job_id in [client.submit(**spec) for _ in range(jobs)]:
        client.wait(job_id, timeout=120)


def in_bulk(client: Client, spec: dict, jobs: int) -> None:
    ended = sum(1 for _ in client.as_completed(client.submit_many([spec] * jobs), timeout=600))
    assert ended == jobs


def report(label: str, latencies: list[float]) -> None:
    print(
        f"{label}: p50 {pct(latencies, 50) * 1e3:.3f} ms, p99 {pct(latencies, 99) * 1e3:.3f} ms, "
        f"mean {statistics.fmean(latencies) * 1e3:.3f} ms over {len(latencies)} jobs"
    )


if __name__ == "__main__":
    main()
