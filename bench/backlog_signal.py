"""The autoscaler's signal with cache-aware placement on and off, in one run: does KEDA see the same
backlog, and so start scaling at the same backlog, whether jobs wait on the queue's shared stream or
on the workers' own streams?

Three echo workers (in this process, each step `--step-ms`, at most `--slots` jobs each) serve one
queue; a producer submits jobs of `--roots` different prompt roots (so placement spreads them over
the workers) faster than the workers end them, for `--seconds`, then stops and lets them drain.
Every `--sample-ms` the run samples:

  true     the jobs submitted and not started: each job's status, read from its hash (`queued`);
  signal   `queue_stats().waiting`: the backlog over every stream that holds the queue's jobs
           (producer_client/protocol/backlog.py), the count the gateway exports as
           mili_queue_waiting_jobs and docker/k8s/scaledobject.yaml's trigger reads.

KEDA's prometheus trigger asks the HPA for ceil(signal / threshold) workers (threshold 64 in the
manifest). Printed per placement: the signal's error against the true backlog (p50, p99, max, in
jobs; a sample is taken in two reads a few ms apart, so a job may start between them), the share of
the true backlog that waited on the workers' own streams, and the true backlog at the first sample
where the asked-for workers exceeded the three running (the backlog at which scaling starts).

    python -m bench.backlog_signal [--seconds 6 --rate 400 --step-ms 10 --max-tokens 20 --slots 4]
"""

from __future__ import annotations

import argparse
import math
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

from bench.measure import pct
from harness.echo_workers import serving
from producer_client import Client
from worker.embedded_redis import EmbeddedRedis

WORKERS = 3
THRESHOLD = 64  # docker/k8s/scaledobject.yaml's threshold: one worker per 64 waiting jobs


@dataclass
class Sample:
    true: int
    signal: int
    placed: int  # of `signal`, the jobs waiting on the workers' own streams


@dataclass
class Run:
    placement: bool
    samples: list[Sample] = field(default_factory=list)
    submitted: int = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="how long the producer submits")
    parser.add_argument("--rate", type=float, default=400.0, help="jobs submitted per second")
    parser.add_argument("--step-ms", type=float, default=10.0, help="each echo engine step")
    parser.add_argument("--max-tokens", type=int, default=20, help="each job's output tokens (its steps)")
    parser.add_argument("--slots", type=int, default=4, help="jobs each worker runs at once")
    parser.add_argument("--roots", type=int, default=24, help="distinct prompt roots the jobs have")
    parser.add_argument("--sample-ms", type=float, default=100.0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    capacity = WORKERS * args.slots / (args.max_tokens * args.step_ms / 1000)
    print(f"{WORKERS} echo workers x {args.slots} slots, {args.max_tokens} steps of {args.step_ms} ms a job: ", end="")
    print(f"about {capacity:.0f} jobs/s served; {args.rate:.0f} jobs/s submitted for {args.seconds} s")
    with EmbeddedRedis() as redis_server:
        runs = [measure(redis_server.url, placement, args) for placement in (False, True)]
    for run in runs:
        report(run)


def measure(url: str, placement: bool, args: argparse.Namespace) -> Run:
    queue = f"signal-{'placed' if placement else 'shared'}"
    run = Run(placement)
    with ExitStack() as stack:
        for i in range(WORKERS):
            stack.enter_context(
                serving(
                    url,
                    queue,
                    step_s=args.step_ms / 1000,
                    name=f"{queue}-w{i}",
                    placement=placement,
                    engine={"max_running": args.slots},
                )
            )
        client = stack.enter_context(Client(url, queue, placement=placement))
        sampler_client = stack.enter_context(Client(url, queue, placement=False))
        wait_for_workers(client)
        job_ids: list[str] = []
        producing = threading.Thread(target=produce, args=(client, job_ids, args), daemon=True)
        producing.start()
        while producing.is_alive() or still_waiting(run):
            run.samples.append(sample(sampler_client, list(job_ids)))
            time.sleep(args.sample_ms / 1000)
        client.results(job_ids, timeout=120)
        run.submitted = len(job_ids)
    return run


def wait_for_workers(client: Client) -> None:
    deadline = time.monotonic() + 30
    while len(client.queue_stats().workers) < WORKERS:
        if time.monotonic() > deadline:
            raise RuntimeError("the workers did not heartbeat")
        time.sleep(0.05)
    time.sleep(0.3)  # every worker's heartbeat (its free slots) is in the producers' placement view


def produce(client: Client, job_ids: list[str], args: argparse.Namespace) -> None:
    """Submit at `rate` for `seconds`, round robin over the roots; each job's prompt is its root and
    its number, so a root's jobs share a prefix and placement sends them to one worker."""
    start = time.monotonic()
    n = 0
    while (elapsed := time.monotonic() - start) < args.seconds:
        due = int(elapsed * args.rate) + 1
        while n < due:
            root = n % args.roots
            job_ids.append(client.submit(f"conversation {root} " * 8 + f"turn {n}", max_tokens=args.max_tokens))
            n += 1
        time.sleep(0.002)


def still_waiting(run: Run) -> bool:
    return not run.samples or run.samples[-1].true > 0 or run.samples[-1].signal > 0


def sample(client: Client, job_ids: list[str]) -> Sample:
    stats = client.queue_stats()
    placed = sum(s.waiting for s in stats.streams if s.worker is not None)
    statuses = client.redis.pipeline(transaction=False)
    for job_id in job_ids:
        statuses.hget(client.keys.job(job_id), "status")
    queued = sum(status == "queued" for status in statuses.execute())
    return Sample(true=queued, signal=stats.waiting, placed=placed)


def report(run: Run) -> None:
    errors = [abs(s.signal - s.true) for s in run.samples]
    busy = [s for s in run.samples if s.true > 0]
    placed_share = sum(s.placed for s in busy) / max(1, sum(s.signal for s in busy))
    first = next((s for s in run.samples if math.ceil(s.signal / THRESHOLD) > WORKERS), None)
    starts = f"{first.true} jobs waiting (signal {first.signal})" if first else "never"
    print(
        f"placement {'on ' if run.placement else 'off'}: {run.submitted} jobs, {len(run.samples)} samples; "
        f"signal - true backlog |error| p50 {pct(errors, 50):.0f} p99 {pct(errors, 99):.0f} max {max(errors)} jobs; "
        f"peak backlog {max(s.true for s in run.samples)}; waiting on workers' own streams {placed_share:.1%} (at most {max(s.placed for s in run.samples)} jobs); "
        f"more than {WORKERS} workers asked for from {starts}"
    )


if __name__ == "__main__":
    main()
