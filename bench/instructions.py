"""Instructions per job of the producer, a worker and redis-server (issue 43), counted by valgrind's
callgrind: a count that the load other work puts on the machine does not move, unlike CPU time, so
that two commits can be told apart by a few percent on a shared machine. For each tree (this one,
and `--against` another worktree), in turn, every process under callgrind:

  1. submit: a producer's `--jobs` submits one after another (bench.peers' job: a distinct prompt,
     max_tokens 1, greedy), no worker running: instructions per submit of the producer and of
     redis-server;
  2. job: one echo worker (`worker serve --model echo`) and a producer's `--jobs` `generate` calls
     one after another (one job at a time, so no batch depends on timing): instructions per job of
     the producer, the worker and redis-server.

Each count is taken between a zero and a dump (callgrind_control) around the timed jobs, after a
warm-up (connections opened, scripts loaded, caches warm). The producer's submit count repeats
to within 0.01% at the same `--jobs` and a like load, within about 1% across loads. A worker's background threads (heartbeat, claims) and
redis-server's cron run by the clock, and a job under callgrind takes some 50 times its usual
time, longer when the machine is loaded: the worker's and redis-server's counts a job move by 5-10%
between runs of the same code (bench/RESULTS.md). For redis-server's scripts alone, bench.lua_costs
--callgrind counts without that work.

    python -m bench.instructions [--against /tmp/base] [--jobs 50] [--only submit job] [--keep DIR]

The producer children import only producer_client (of the tree under test) and the standard
library: this file is run by its path with `python -P`, with that tree first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve()
TREE = HERE.parent.parent
QUEUE = "bench"
WARMUP = 30
VALGRIND = ["valgrind", "--tool=callgrind", "--dump-instr=no", "--compress-strings=no"]


def main() -> None:
    args = parse_args()
    if args.child:
        return child_main(args)
    trees = {"this": TREE} | ({"against": Path(args.against).resolve()} if args.against else {})
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print("trees: " + ", ".join(f"{name} {path} ({commit_of(path)})" for name, path in trees.items()))
    figures = {name: measure_tree(tree, args) for name, tree in trees.items()}
    report(figures)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--against", help="another tree (a git worktree) to measure beside this one")
    p.add_argument("--jobs", type=int, default=50, help="submits, and jobs, counted")
    p.add_argument("--only", nargs="+", default=["submit", "job"], choices=["submit", "job"])
    p.add_argument("--keep", help="a folder to keep callgrind's dumps in (for callgrind_annotate)")
    p.add_argument("--child", choices=["submit", "job"], help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    return p.parse_args()


def commit_of(tree: Path) -> str:
    done = subprocess.run(["git", "-C", str(tree), "log", "-1", "--format=%h"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "-uno"], capture_output=True, text=True)
    return done.stdout.strip() + (" +changes" if dirty.stdout.strip() else "")


def measure_tree(tree: Path, args: argparse.Namespace) -> dict[str, float]:
    from worker.embedded_redis import free_port, redis_server_binary

    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="mili-instr-") as scratch:
        out = str(Path(args.keep) / tree.name) if args.keep else scratch
        Path(out).mkdir(parents=True, exist_ok=True)
        port = free_port()
        url = f"redis://127.0.0.1:{port}/0"
        env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
        binary = redis_server_binary()
        if binary is None:
            sys.exit("no redis-server found")
        server = [binary, "--port", str(port), "--save", "", "--appendonly", "no"]
        with counted(server, out, "redis", env, tree) as redis_server:
            wait_for_redis(url)
            if "submit" in args.only:
                counts = timed_jobs(tree, url, "submit", args.jobs, env, out, {"redis": redis_server})
                figures |= {f"submit {name}": count / args.jobs for name, count in counts.items()}
                flush(url)
            if "job" in args.only:
                serve = [sys.executable, "-m", "worker", "serve", "--model", "echo", "--redis", url, "--queue", QUEUE]
                serve += ["--name", "bench-worker-0", "--metrics-port", "0", "--log-level", "WARNING"]
                with counted(serve, out, "worker", env, tree) as worker:
                    others = {"worker": worker, "redis": redis_server}
                    counts = timed_jobs(tree, url, "job", args.jobs, env, out, others)
                figures |= {f"job {name}": count / args.jobs for name, count in counts.items()}
    print(f"{tree}: " + ", ".join(f"{k} {v:,.0f}" for k, v in figures.items()), flush=True)
    return figures


@contextlib.contextmanager
def counted(command: list[str], out: str, name: str, env: dict, cwd: Path) -> Iterator[subprocess.Popen]:
    """`command` run under callgrind, its dumps in `out`; stopped at the end."""
    log = open(Path(out) / f"{name}.log", "w")
    cg = [*VALGRIND, f"--callgrind-out-file={out}/{name}.%p.out"]
    process = subprocess.Popen([*cg, *command], env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def wait_for_redis(url: str) -> None:
    import redis

    deadline = time.monotonic() + 120
    while True:
        try:
            with redis.Redis.from_url(url) as r:
                r.ping()
                return
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def flush(url: str) -> None:
    import redis

    with redis.Redis.from_url(url) as r:
        r.flushall()


def timed_jobs(
    tree: Path, url: str, mode: str, jobs: int, env: dict, out: str, others: dict[str, subprocess.Popen]
) -> dict[str, int]:
    """The producer child's `jobs` of `mode`, counted in it and in `others` between a zero and a dump."""
    command = [sys.executable, "-P", str(HERE), "--child", mode, "--url", url, "--jobs", str(jobs)]
    cg = [*VALGRIND, f"--callgrind-out-file={out}/producer-{mode}.%p.out"]
    with open(Path(out) / f"producer-{mode}.log", "w") as log:
        producer = subprocess.Popen(
            [*cg, *command], env=env, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True
        )
        processes = {"producer": producer} | others
        expect(producer, "ready", Path(log.name))
        for process in processes.values():
            control("-z", process.pid)
        tell(producer)
        expect(producer, "done", Path(log.name))
        for process in processes.values():
            control("-d", process.pid)
        tell(producer)
        producer.wait(timeout=120)
    return {name: last_dump(out, process.pid) for name, process in processes.items()}


def expect(producer: subprocess.Popen, word: str, log: Path) -> None:
    assert producer.stdout is not None
    line = producer.stdout.readline()
    if not line or json.loads(line) != word:
        sys.exit(f"the producer said {line!r}, not {word!r}:\n{log.read_text()[-4000:]}")


def tell(producer: subprocess.Popen) -> None:
    assert producer.stdin is not None
    producer.stdin.write("go\n")
    producer.stdin.flush()


def control(action: str, pid: int) -> None:
    subprocess.run(["callgrind_control", action, str(pid)], check=True, capture_output=True)


def last_dump(out: str, pid: int) -> int:
    """Instructions of `pid`'s newest dump (its `summary:` line)."""
    dumps = sorted(Path(out).glob(f"*.{pid}.out.*"), key=lambda p: int(p.suffix[1:]))
    for line in dumps[-1].read_text(errors="replace").splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {dumps[-1]}")


def report(figures: dict[str, dict[str, float]]) -> None:
    names = list(figures)
    print(f"\ninstructions per job ({'; '.join(names)}):")
    print(f"{'':22}" + "".join(f"{name:>16}" for name in names) + ("   this/against" if len(names) > 1 else ""))
    for key in figures[names[0]]:
        row = f"{key:22}" + "".join(f"{figures[name][key]:>16,.0f}" for name in names)
        if len(names) > 1:
            row += f"   {figures['this'][key] / figures['against'][key]:.3f}x"
        print(row)


# -- the child: a producer of one tree, under callgrind -----------------------------------------------


def child_main(args: argparse.Namespace) -> None:
    from producer_client import Client

    with Client(args.url, QUEUE) as client:
        prompts = iter([f"hello world, job {i:06d}" for i in range(WARMUP + args.jobs)])
        if args.child == "submit":

            def one() -> None:
                client.submit(next(prompts), max_tokens=1, temperature=0.0)
        else:

            def one() -> None:
                client.generate(next(prompts), max_tokens=1, temperature=0.0, timeout=600)

        for _ in range(WARMUP):
            one()
        say("ready")
        for _ in range(args.jobs):
            one()
        say("done")


def say(word: str) -> None:
    print(json.dumps(word), flush=True)
    if not sys.stdin.readline():
        sys.exit("the driver went away")


if __name__ == "__main__":
    main()
