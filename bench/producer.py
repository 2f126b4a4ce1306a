"""The producer's own cost (issue 43, item 3), for this tree and for another one (`--against`, a
worktree of an earlier commit) in the same run: rounds alternate the trees (which goes first
alternates too), each round of each tree a fresh process with that tree first on PYTHONPATH,
against one redis-server over TCP, with no worker running.

  1. one `submit` (a distinct prompt, max_tokens 1, greedy: bench/peers.py's job), `--submits`
     one after another: wall and CPU (time.process_time) per submit; then the calls of one submit,
     the median of PROFILED: cProfile's (all, and Python functions alone), and sys.setprofile's
     Python frames entered (calls and generator resumes alike);
  2. `submit_many` of `--bulk-jobs` distinct specs (built before the clock starts) with placement
     on (the client's default): jobs/s and CPU per job. `--workers N` advertises N placement-aware
     workers (heartbeats written here, no process behind them), so that placement places jobs on
     their own streams, `--slots` each, and the rest on the shared stream; 0 (the default): no
     worker, every job to the shared stream after the view is read.

    python -m bench.producer --against /tmp/base [--rounds 4 --submits 2000 --bulk-jobs 40000 --workers 0]

The child processes import only producer_client (of the tree under test) and the standard library:
this file is run by its path with `python -P`, so nothing of this tree's bench/ shadows the other's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
TREE = HERE.parent.parent
PROFILED = 21
WARMUP = 50  # submits before the clock starts: connections opened, scripts loaded, caches warm
FIGURES = (
    ("submit_wall_us", "submit wall us", "{:.1f}"),
    ("submit_cpu_us", "submit CPU us", "{:.1f}"),
    ("submit_calls", "calls/submit (cProfile)", "{:.0f}"),
    ("submit_python_calls", "Python calls/submit (cProfile)", "{:.0f}"),
    ("submit_frames", "Python frames/submit (setprofile)", "{:.0f}"),
    ("many_jobs_s", "submit_many jobs/s", "{:,.0f}"),
    ("many_cpu_us", "submit_many CPU us/job", "{:.1f}"),
)


def main() -> None:
    args = parse_args()
    if args.child:
        return child_main(args)
    from worker.embedded_redis import EmbeddedRedis, free_port

    trees = {"this": TREE} | ({"against": Path(args.against).resolve()} if args.against else {})
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print("trees: " + ", ".join(f"{name} {path} ({commit_of(path)})" for name, path in trees.items()))
    figures: dict[str, list[dict]] = {name: [] for name in trees}
    with EmbeddedRedis(port=free_port()) as server:
        for round_ in range(args.rounds):
            names = list(trees) if round_ % 2 == 0 else list(trees)[::-1]
            for name in names:
                one = run_child(trees[name], server.url, f"bench-{round_}-{name}", args)
                figures[name].append(one)
                print(f"round {round_ + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in one.items()), flush=True)
                flush(server.url)
    print(f"(load average {os.getloadavg()[0]:.2f} at end)\n")
    report(figures)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", help="another tree (a git worktree) to measure beside this one")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--submits", type=int, default=2000, help="submits timed one after another")
    p.add_argument("--bulk-jobs", type=int, default=40_000, help="jobs of the timed submit_many")
    p.add_argument("--workers", type=int, default=0, help="placement-aware workers advertised (no processes)")
    p.add_argument("--slots", type=int, default=256, help="slots of each advertised worker")
    p.add_argument("--child", nargs=2, metavar=("URL", "QUEUE"), help=argparse.SUPPRESS)
    return p.parse_args()


def commit_of(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h %cs"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return done.stdout.strip() + (" +changes" if dirty.stdout.strip() else "")


def run_child(tree: Path, url: str, queue: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-P", str(HERE), "--child", url, queue, "--submits", str(args.submits)]
    command += ["--bulk-jobs", str(args.bulk_jobs), "--workers", str(args.workers), "--slots", str(args.slots)]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"the child of {tree} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def flush(url: str) -> None:
    import redis

    with redis.Redis.from_url(url) as r:
        r.flushall()


def report(figures: dict[str, list[dict]]) -> None:
    medians = {
        name: {key: statistics.median(f[key] for f in runs) for key, _, _ in FIGURES} for name, runs in figures.items()
    }
    names = list(figures)
    print(f"medians of {len(figures['this'])} rounds:")
    print(f"{'':36}" + "".join(f"{name:>14}" for name in names) + ("   this/against" if len(names) > 1 else ""))
    for key, label, form in FIGURES:
        row = f"{label:36}" + "".join(f"{form.format(medians[name][key]):>14}" for name in names)
        if len(names) > 1 and medians["against"][key]:
            row += f"   {medians['this'][key] / medians['against'][key]:.2f}x"
        print(row)
    if len(names) > 1:
        ranges = {name: [f["many_jobs_s"] for f in runs] for name, runs in figures.items()}
        print(
            "submit_many jobs/s per round: "
            + "; ".join(f"{name} {', '.join(f'{x:,.0f}' for x in r)}" for name, r in ranges.items())
        )


# -- the child: one tree's figures, in a process of its own ------------------------------------------


def child_main(args: argparse.Namespace) -> None:
    from producer_client import Client

    url, queue = args.child
    with Client(url, queue) as client:
        figures = submit_figures(client, args.submits)
    with Client(url, f"{queue}-bulk", max_queue_depth=None) as client:
        advertise_workers(client, f"{queue}-bulk", args.workers, args.slots)
        figures |= bulk_figures(client, args.bulk_jobs)
    print(json.dumps(figures), flush=True)


def submit_figures(client, jobs: int) -> dict:
    prompts = iter([f"hello world, job {i:06d}" for i in range(WARMUP + jobs + 2 * PROFILED)])

    def submit() -> None:
        client.submit(next(prompts), max_tokens=1, temperature=0.0)

    for _ in range(WARMUP):
        submit()
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(jobs):
        submit()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    profiled = [profiled_calls(submit) for _ in range(PROFILED)]
    frames = [frames_entered(submit) for _ in range(PROFILED)]
    return {
        "submit_wall_us": wall / jobs * 1e6,
        "submit_cpu_us": cpu / jobs * 1e6,
        "submit_calls": statistics.median(c[0] for c in profiled),
        "submit_python_calls": statistics.median(c[1] for c in profiled),
        "submit_frames": statistics.median(frames),
    }


def profiled_calls(call) -> tuple[int, int]:
    """cProfile's calls of one `call`: all, and of Python functions alone (a C function's file is '~')."""
    profile = cProfile.Profile()
    profile.enable()
    call()
    profile.disable()
    stats = pstats.Stats(profile)
    python = sum(entry[1] for (file, _, _), entry in stats.stats.items() if file != "~")
    return stats.total_calls, python


def frames_entered(call) -> int:
    count = 0

    def hook(frame, event, arg) -> None:
        nonlocal count
        if event == "call":
            count += 1

    sys.setprofile(hook)
    try:
        call()
    finally:
        sys.setprofile(None)
    return count - 1  # the call of `call` itself


def advertise_workers(client, queue: str, workers: int, slots: int) -> None:
    """Heartbeats of `workers` placement-aware, lane-reading workers of `queue`, idle, `slots` each."""
    for i in range(workers):
        name = f"bench-worker-{i}"
        beat = {"name": name, "queue": queue, "state": "serving", "placement": "1", "lanes": "1"}
        client.redis.hset(client.keys.worker(name), mapping=beat | {"running": 0, "slots": slots, "placed_held": 0})
        client.redis.zadd(client.keys.workers(queue), {name: time.time()})


def bulk_figures(client, jobs: int) -> dict:
    warm = [{"prompt": f"warm-up {i}", "max_tokens": 1, "temperature": 0.0} for i in range(1000)]
    specs = [{"prompt": f"hello world, job {i:06d}", "max_tokens": 1, "temperature": 0.0} for i in range(jobs)]
    client.submit_many(warm)
    cpu, wall = time.process_time(), time.perf_counter()
    ids = client.submit_many(specs)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert len(set(ids)) == jobs
    return {"many_jobs_s": jobs / wall, "many_cpu_us": cpu / jobs * 1e6}


if __name__ == "__main__":
    main()
