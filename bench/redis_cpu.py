"""Redis's cost per 1-token job, and where it goes (issue 43: Redis CPU per job <= 40 us): bench.peers'
MILI load run (2 echo workers, 2 producer processes x 8 producers each submitting a job and waiting
for its result, a fresh redis-server) measured between the go and the last result: redis-server's
CPU per job (/proc, and INFO cpu's used_cpu_sys + used_cpu_user), its commands per job (INFO stats
total_commands_processed: a script's commands count too), its round trips per job (INFO stats
total_reads_processed: one read event a client's pipeline), and per command its calls and
microseconds per job (INFO commandstats; an EVALSHA's time includes its commands', which are
counted under their own names as well).

With `--before TREE` (a checkout of another commit, e.g. `git worktree add --detach /tmp/base
<commit>`), the rounds alternate that tree's code and this one's, on the same machine and in the
same hour, so that the load other work puts on the machine falls on both alike; CPU per job moves
less with that load than jobs/s does.

With `--procs 1 --producers 1`, one job at a time: the workers wait idle between jobs, and each
job pays every round trip alone (no batch shares them).

    python -m bench.redis_cpu [--rounds 3 --seconds 3] [--procs 2 --producers 8] [--before /tmp/base]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.peer_queues.redis_costs import RedisCosts

ROOT = Path(__file__).resolve().parents[1]
FIGURES = ("jobs_per_s", "redis_cpu_us", "user_us", "sys_us", "commands", "round_trips", "writes")


def one_run(seconds: float, procs: int = 2, producers: int = 8) -> dict:
    """One load run of the code on sys.path (bench.peers of the tree the run was started in): its
    modules are imported here, in that run's process. `procs` producer processes of `producers`
    producers each."""
    from bench import peers
    from bench.peer_queues.processes import WorkerGroup
    from bench.peer_queues.redis_costs import RedisCosts
    from worker.embedded_redis import EmbeddedRedis, free_port

    args = argparse.Namespace(seconds=seconds, procs=procs, producers=producers, poll_s=0.001)
    lib = peers.LIBRARIES[0]
    with EmbeddedRedis(port=free_port()) as server, tempfile.TemporaryDirectory(prefix="mili-rcpu-") as logs:
        env = peers.run_environment(server.url, lib, args)
        costs = RedisCosts(server)
        with WorkerGroup(lib.workers(sys.executable, server.url), env, Path(logs)):
            producers = peers.start_load(sys.executable, lib, env, args)
            time.sleep(1.0)  # the workers' start-up commands done
            before = snapshot(costs)
            jobs, elapsed, _ = peers.run_load(producers)
            after = snapshot(costs)
            for producer in producers:
                producer.finish()
        costs.close()
    counted = ("cpu", "info_cpu", "user", "sys", "commands", "reads", "writes")
    per_job = {name: (after[name] - before[name]) / jobs for name in counted}
    return {
        "jobs_per_s": jobs / elapsed,
        "redis_cpu_us": per_job["cpu"] * 1e6,
        "info_cpu_us": per_job["info_cpu"] * 1e6,
        "user_us": per_job["user"] * 1e6,
        "sys_us": per_job["sys"] * 1e6,
        "commands": per_job["commands"],
        "round_trips": per_job["reads"],
        "writes": per_job["writes"],
        "per_command": RedisCosts.per_job(before["stats"], after["stats"], jobs),
    }


def snapshot(costs: RedisCosts) -> dict:
    stats, cpu = costs.redis.info("stats"), costs.redis.info("cpu")
    return {
        "cpu": costs.cpu(),
        "info_cpu": cpu["used_cpu_sys"] + cpu["used_cpu_user"],
        "user": cpu["used_cpu_user"],
        "sys": cpu["used_cpu_sys"],
        "commands": stats["total_commands_processed"],
        "reads": stats["total_reads_processed"],
        "writes": stats["total_writes_processed"],
        "stats": costs.commandstats(),
    }


def run_in(tree: Path, args: argparse.Namespace) -> dict:
    """one_run of `tree`'s code, in a process of its own started there."""
    from bench.measure import one_run_in  # here: this file also runs in older trees, that lack it

    return one_run_in(tree, str(Path(__file__)), f"{args.seconds}, {args.procs}, {args.producers}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--procs", type=int, default=2, help="producer processes (bench.peers': 2)")
    p.add_argument("--producers", type=int, default=8, help="producers a process, each submitting and waiting (8)")
    p.add_argument("--before", type=Path, help="a tree of the code to compare with, run in alternation")
    args = p.parse_args()
    trees = {"before": args.before, "after": ROOT} if args.before else {"this": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    print(f"load average at the start: {load_average()}")
    for round_ in range(1, args.rounds + 1):
        for name, tree in trees.items():
            run = run_in(tree, args)
            runs[name].append(run)
            print(f"round {round_} {name:6} " + "  ".join(f"{f} {run[f]:,.2f}" for f in FIGURES), flush=True)
    print(f"load average at the end: {load_average()}\n")
    print("| code | " + " | ".join(FIGURES) + " |\n|---|" + "---|" * len(FIGURES))
    for name, figures in runs.items():
        print(
            f"| {name} (median of {args.rounds}) | " + " | ".join(f"{median(figures, f):,.2f}" for f in FIGURES) + " |"
        )
    print_commands(runs)


def print_commands(runs: dict[str, list[dict]]) -> None:
    """Each command's calls and microseconds per job, the median over the rounds, heaviest first."""
    names = sorted({c for figures in runs.values() for run in figures for c in run["per_command"]})
    rows = {c: {n: per_command_median(f, c) for n, f in runs.items()} for c in names}
    order = sorted(rows, key=lambda c: -max(us for _, us in rows[c].values()))
    print("\n| command | " + " | ".join(f"{n}: calls/job, us/job" for n in runs) + " |\n|---|" + "---|" * len(runs))
    for c in order:
        if max(us for _, us in rows[c].values()) >= 0.05:
            print(f"| {c} | " + " | ".join(f"{calls:.3f}, {us:.2f}" for calls, us in rows[c].values()) + " |")


def per_command_median(figures: list[dict], command: str) -> tuple[float, float]:
    pairs = [run["per_command"].get(command, (0.0, 0.0)) for run in figures]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def median(figures: list[dict], name: str) -> float:
    return statistics.median(run[name] for run in figures)


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


if __name__ == "__main__":
    main()
