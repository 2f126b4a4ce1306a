"""A queue spread over shards on a Redis Cluster of M masters on loopback (`--masters`, 3 or 6,
each with a replica; docs/architecture.md, "A queue over several shards"): how its Redis CPU
divides among the masters, and jobs/s, with one shard and with M, in alternating rounds (the
machine may be shared: each round runs both).

Each run takes a fresh queue (with M shards, one whose shards' tags lie on M different masters),
starts echo workers (`--model echo`, `--queue-shards N`), warms them up, then one producer sends
`--jobs` one-token jobs with submit_many (queue_shards=N), which the workers run meanwhile, and
collects their results with as_completed; the window runs from the first submit to the last
result. Per master: used_cpu_sys + used_cpu_user (INFO cpu) over the window; the busiest master's
share of the M is the figure (a job's own keys, `mili:job:{id}`, spread over every master
whatever N: what N moves is the queue's keys).

With --fair-jobs J it measures the fair shares instead, on one embedded redis-server: tenant
team-a submits 4J jobs and team-b J (8 tokens each, default lane, equal weights) on a queue of N
shards, then one echo worker (16 jobs at a time) starts there; each tenant's share of the tokens
started while both had work waiting, N = 1 and N = 3 in alternating rounds. With jobs spread by a
hash the shares hold per shard, and across shards in expectation.

    python -m bench.shards [--masters 3 --rounds 3 --jobs 6000 --workers 3]
    python -m bench.shards --fair-jobs 1000 [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import uuid
from pathlib import Path

from bench.tenants import shares_while_both_wait, specs, tokens
from harness.processes import start_worker
from harness.redis_servers import LocalCluster
from producer_client import Client
from producer_client.keys import Keys
from worker.embedded_redis import EmbeddedRedis, free_port


def main() -> None:
    args = parse_args()
    if args.fair_jobs:
        fair_main(args)
        return
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    counts = (1, args.masters)
    print(
        f"{args.masters} masters (a replica each), {args.jobs} one-token echo jobs per run, {args.workers} echo "
        f"workers, {args.rounds} rounds of N = {counts[0]}, {counts[1]}\n"
    )
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="mili-bench-shards-") as root,
        LocalCluster(Path(root), masters=args.masters) as cluster,
    ):
        for round_ in range(1, args.rounds + 1):
            for shards in counts:
                jobs_s, shares = run(cluster.url, shards, args)
                rows.append((round_, shards, jobs_s, shares))
                print(
                    f"round {round_}, N = {shards}: {jobs_s:,.0f} jobs/s; masters' share of Redis CPU "
                    + " / ".join(f"{s:.0%}" for s in shares)
                    + f"; busiest {max(shares):.0%}"
                    + f"; load average {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    for shards in counts:
        mine = [r for r in rows if r[1] == shards]
        print(
            f"N = {shards}: busiest master {min(max(r[3]) for r in mine):.0%}-{max(max(r[3]) for r in mine):.0%}, "
            f"{min(r[2] for r in mine):,.0f}-{max(r[2] for r in mine):,.0f} jobs/s"
        )
    print(f"(load average {os.getloadavg()[0]:.2f} at end)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--masters", type=int, choices=(3, 6), default=3, help="the cluster's masters, M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=6000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--fair-jobs", type=int, default=0, help="measure the fair shares with this many jobs")
    return parser.parse_args()


def fair_main(args: argparse.Namespace) -> None:
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(f"team-a {4 * args.fair_jobs} jobs, team-b {args.fair_jobs}, equal weights, one worker; fair share 50%\n")
    with EmbeddedRedis(port=free_port()) as server:
        for round_ in range(1, args.rounds + 1):
            for shards in (1, 3):
                shares = shares_while_both_wait(parked_shards_run(server.url, shards, args.fair_jobs), tokens)
                print(
                    f"round {round_}, N = {shards}: team-a {shares['team-a']:.1f}%, team-b {shares['team-b']:.1f}%",
                    flush=True,
                )


def parked_shards_run(url: str, shards: int, jobs: int) -> dict[str, list]:
    """bench.tenants' parked run on a queue of `shards` shards: both tenants' jobs submitted before
    the worker starts, so both have work waiting from its first read. Their results."""
    queue = f"fair-{uuid.uuid4().hex[:6]}"
    with Client(url, queue, queue_shards=shards, placement=False) as client:
        ids = {
            "team-a": client.as_tenant("team-a").submit_many(specs(4 * jobs)),
            "team-b": client.as_tenant("team-b").submit_many(specs(jobs)),
        }
        worker = start_worker(url, queue, "--queue-shards", str(shards), "--max-running", "16", name=f"w-{queue}")
        try:
            by_id = {r.id: r for r in client.as_completed([i for v in ids.values() for i in v], timeout=600)}
        finally:
            worker.terminate()
            worker.wait(timeout=30)
    return {name: [by_id[i] for i in job_ids] for name, job_ids in ids.items()}


def run(url: str, shards: int, args: argparse.Namespace) -> tuple[float, list[float]]:
    with Client(url, "probe") as probe:
        queue = spread_queue(probe, shards)
        masters = probe.redis.get_primaries()
        flags = ("--queue-shards", str(shards), "--max-running", "64")
        workers = [start_worker(url, queue, *flags, name=f"{queue}-w{i}") for i in range(args.workers)]
        try:
            with Client(url, queue, queue_shards=shards, placement=False) as client:
                warm = client.submit_many([{"prompt": "warm", "max_tokens": 1}] * 60)
                list(client.as_completed(warm, timeout=120))
                before = [master_cpu(m) for m in masters]
                elapsed = produce_and_collect(client, args.jobs)
                used = [master_cpu(m) - b for m, b in zip(masters, before)]
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(timeout=30)
    return args.jobs / elapsed, [u / sum(used) for u in used]


def spread_queue(client: Client, shards: int) -> str:
    """A fresh queue name whose `shards` shards' tags lie on as many different masters."""
    while True:
        name = f"bench-{uuid.uuid4().hex[:8]}"
        nodes = {client.redis.get_node_from_key(client.keys.queue(Keys.shard(name, i))).name for i in range(shards)}
        if len(nodes) == shards:
            return name


def master_cpu(node) -> float:
    info = node.redis_connection.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def produce_and_collect(client: Client, jobs: int) -> float:
    """Seconds from the first submit to the last result: submit_many in chunks of 500 (the workers
    run them meanwhile), then as_completed over them all."""
    t0 = time.perf_counter()
    ids: list[str] = []
    for start in range(0, jobs, 500):
        ids += client.submit_many([{"prompt": "x", "max_tokens": 1}] * min(500, jobs - start))
    done = sum(1 for r in client.as_completed(ids, timeout=600) if r.status == "done")
    elapsed = time.perf_counter() - t0
    assert done == jobs, f"{done} of {jobs} jobs done"
    return elapsed


if __name__ == "__main__":
    main()
