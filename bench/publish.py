"""Publication benchmark (issue 25): what publishing generated tokens costs the worker and Redis,
for this tree beside a baseline tree (a worktree of an older commit) in the same run.

One echo worker (`--model echo`: no model; each job's output is its prompt, one token per step)
at batch 256 runs 256 jobs of 512 tokens on an embedded redis-server, in these cases per tree:

- whole: the results read whole (`as_completed`), nobody streaming;
- streamed: a reader on `stream()` for every job (the asyncio client), submitted as streamed (a
  tree older than the submit option `stream`, STREAM_OPTION, learns it from its readers' FOLLOW);
- whole-gpu, streamed-gpu: the same, each echo step standing for a GPU step of --device-step-ms
  (12 ms: Qwen3-0.6B at batch 256 on an H100), overlapped as the overlap scheduler runs on a GPU
  (bench/publish_probe.py): the steps' period shows whether publication stays hidden behind them;
- per-job: 1-token jobs through `Client.generate` from several producer threads (Redis's CPU per job);

and prints, per case, the worker's and redis-server's CPU per generated token (per job for 1-token
jobs; from /proc, so other processes on the machine do not count), of the worker's the part spent in
the echo engine's steps (its own output, the work a model's engine does its own way), tokens/s, INFO
commandstats' top commands (and a whole case's XADD and HMGET calls: a job's writes and reads of its
hash), the step-time stall (the longest time the queue loop spent on publication between two engine
steps, and its p99), the steps' period, and for streamed jobs each token's delay from its sampling
to its reader (tokens sampled after the reader's first read). Then the ratios, new against baseline.

    python -m bench.publish [--baseline /tmp/mili-base-25] [--jobs 256 --tokens 512] [--rounds 1]

Each tree's jobs are submitted and read by that tree's own client, in a process of their own
(bench/publish_jobs.py), as its worker runs that tree's code: a reader of a newer client against an
older worker would measure neither version (this tree's stream() waits for events the scripts
publish, which an older worker does not, and read it only at its silence reads).

The baseline worktree is made (`git worktree add --detach`) from --baseline-commit when missing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from tqdm import tqdm

from bench.measure import cpu_seconds, pct
from worker.embedded_redis import EmbeddedRedis

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "bench" / "publish_probe.py"
JOBS = REPO / "bench" / "publish_jobs.py"
QUEUE = "bench"
BASELINE_COMMIT = "eceecb5"  # main before issue 25
STREAM_OPTION = "5a0c25d"  # the submit option `stream`: an older tree's streamed jobs are followed by their readers


@dataclass
class Case:
    tree: str  # "baseline" or "new"
    mode: str  # "whole", "streamed", "per-job"
    units: int = 0  # tokens generated (or jobs, per job)
    wall_s: float = 0.0
    worker_cpu_s: float = 0.0
    redis_cpu_s: float = 0.0
    commands: dict = field(default_factory=dict)
    probe: dict = field(default_factory=dict)
    delays: list[tuple[float, float]] = field(default_factory=list)  # (to Redis, to the reader) per token
    redis_sys_share: float = 0.0  # of redis-server's CPU, the kernel's (its I/O)
    worker_sys_share: float = 0.0  # of the worker's CPU, the kernel's (its I/O, sleeps and wake-ups)
    loop_cpu_s: float = 0.0  # of the worker's CPU, its loop thread's (the process's main thread)

    @property
    def unit(self) -> str:
        return "job" if self.mode == "per-job" else "token"

    def per_unit_us(self, cpu_s: float) -> float:
        return cpu_s / self.units * 1e6

    @property
    def engine_cpu_s(self) -> float:
        return self.probe.get("engine_cpu_s", 0.0)

    def stalls(self) -> list[float]:
        return self.probe.get("stalls") or [0.0]


def main() -> None:
    args = parse_args()
    baseline = ensure_baseline(Path(args.baseline), args.baseline_commit)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(f"baseline tree {baseline} (commit {git_head(baseline)}), new tree {REPO} (commit {git_head(REPO)})")
    print(
        f"{args.jobs} jobs x {args.tokens} tokens, echo engine, batch {args.jobs}; per job: {args.per_job_jobs} 1-token jobs\n"
    )
    cases: list[Case] = []
    plan = [
        (mode, tree, path)
        for _ in range(args.rounds)
        for mode in args.modes
        for tree, path in (("baseline", baseline), ("new", REPO))
        if tree in args.trees
    ]
    for mode, tree, path in tqdm(plan, unit="case", desc="cases"):
        case = run_case(tree, path, mode, args)
        report(case)
        cases.append(case)
    print()
    compare(cases)
    print(f"(load average {os.getloadavg()[0]:.2f} at end)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", default="/tmp/mili-base-25", help="the baseline tree (a git worktree)")
    p.add_argument("--baseline-commit", default=BASELINE_COMMIT, help="its commit, if the worktree is to be made")
    p.add_argument("--jobs", type=int, default=256, help="jobs at once (the worker's max_running)")
    p.add_argument("--tokens", type=int, default=512, help="tokens per job")
    p.add_argument("--per-job-jobs", type=int, default=10_000, help="1-token jobs in the per-job case")
    p.add_argument("--producers", type=int, default=8, help="producer threads in the per-job case")
    p.add_argument("--modes", nargs="+", default=["whole", "streamed", "whole-gpu", "streamed-gpu", "per-job"])
    p.add_argument("--device-step-ms", type=float, default=12.0, help="the GPU step the -gpu cases stand for")
    p.add_argument("--trees", nargs="+", default=["baseline", "new"], help="which trees to run")
    p.add_argument("--rounds", type=int, default=1, help="repeat every case, alternating the trees")
    p.add_argument("--profile", help="write each worker's cProfile to this directory")
    p.add_argument(
        "--inline-publisher",
        action="store_true",
        help="this tree's rounds sent in the loop's thread (the overlap's idle time) instead of a thread",
    )
    p.add_argument(
        "--new-flags", default="", help="more worker flags for this tree's worker, e.g. '--stream-interval-s 0.1'"
    )
    p.add_argument(
        "--new-redis-config",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a CONFIG SET of redis-server's for this tree's cases, e.g. stream-node-max-entries 16",
    )
    return p.parse_args()


def ensure_baseline(path: Path, commit: str) -> Path:
    if not path.exists():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), commit], check=True)
    return path.resolve()  # its processes run in it, with it on sys.path


def git_head(path: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def run_case(tree: str, path: Path, mode: str, args) -> Case:
    case = Case(tree, mode)
    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="mili-bench-publish-") as tmp:
        if tree == "new":
            configure(server.url, args.new_redis_config)
        out = Path(tmp) / "probe.json"
        worker = start_worker(path, server.url, out, mode, args, tree)
        jobs = start_jobs(path, server.url, Path(tmp) / "jobs.json", mode, args)
        try:
            wait_ready(jobs, path, worker)
            admin = redis.Redis(unix_socket_path=server.url.removeprefix("unix://"), decode_responses=True)
            admin.config_resetstat()
            cpu_before = admin.info("cpu")
            before = cpu_seconds(worker.pid), cpu_seconds(server.process.pid), time.perf_counter()
            threads_before = worker_threads(worker.pid)
            run_jobs(jobs)
            case.wall_s = time.perf_counter() - before[2]
            case.worker_cpu_s = cpu_seconds(worker.pid) - before[0]
            case.loop_cpu_s, case.worker_sys_share = threads_since(worker.pid, threads_before)
            case.redis_cpu_s = cpu_seconds(server.process.pid) - before[1]
            case.commands = admin.info("commandstats")
            cpu_after = admin.info("cpu")
            case.redis_sys_share = (cpu_after["used_cpu_sys"] - cpu_before["used_cpu_sys"]) / max(
                1e-9, sum(cpu_after[k] - cpu_before[k] for k in ("used_cpu_sys", "used_cpu_user"))
            )
            admin.close()
            if jobs.wait(timeout=120) != 0:
                raise RuntimeError(f"the {tree} tree's producers failed")
        finally:
            jobs.kill()
            jobs.wait()
            worker.terminate()
            worker.wait(timeout=60)
        case.probe = json.loads(out.read_text())
        answer = json.loads((Path(tmp) / "jobs.json").read_text())
    case.units = answer["units"]
    if mode.startswith("streamed"):
        case.delays = token_delays(answer["arrivals"], answer["starts"], case.probe["samples"])
    return case


def worker_threads(pid: int) -> tuple[int, int, int]:
    """The worker's CPU so far: its loop thread's and all its threads' (ns, from each thread's
    /proc schedstat; the loop thread is the process's main one), and its system time (clock ticks)."""
    run_ns = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            run_ns[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:  # the thread ended between the listing and this read
            continue
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return run_ns[pid], sum(run_ns.values()), int(fields[12])


def threads_since(pid: int, before: tuple[int, int, int]) -> tuple[float, float]:
    """The loop thread's CPU seconds since `before` (worker_threads), and the kernel's share of the
    worker's CPU meanwhile. A thread that ended meanwhile takes its time with it: the share is of
    the threads alive at both readings."""
    loop, total, system = (now - then for now, then in zip(worker_threads(pid), before))
    return loop / 1e9, min(1.0, system / os.sysconf("SC_CLK_TCK") / max(1e-9, total / 1e9))


def configure(url: str, settings: list[tuple[str, str]]) -> None:
    """The server's settings (CONFIG SET) before the worker starts."""
    with redis.Redis(unix_socket_path=url.removeprefix("unix://")) as admin:
        for name, value in settings:
            admin.config_set(name, value)


def start_worker(tree: Path, url: str, out: Path, mode: str, args, tree_name: str) -> subprocess.Popen:
    flags = [
        "--model",
        "echo",
        "--redis",
        url,
        "--queue",
        QUEUE,
        "--name",
        f"bench-{tree_name}",
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        "--log-level",
        "WARNING",
        "--max-running",
        str(args.jobs),
        "--num-pages",
        str(args.jobs * -(-2 * args.tokens // 16) + 64),
        "--max-model-len",
        str(2 * args.tokens + 16),
    ]
    if tree_name == "new":
        flags += args.new_flags.split()
        if args.inline_publisher:
            flags.append("--inline-publisher")
    command = [sys.executable, str(PROBE), str(tree), str(out), *flags]
    if mode.startswith("streamed"):
        command.append("--samples")
    if mode.endswith("-gpu"):
        command += ["--device-step-ms", str(args.device_step_ms)]
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        prof = Path(args.profile) / f"{tree_name}-{mode}.prof"
        command = [sys.executable, "-m", "cProfile", "-o", str(prof), *command[1:]]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(command, cwd=tree, env=env)


def start_jobs(tree: Path, url: str, out: Path, mode: str, args) -> subprocess.Popen:
    """The case's producers and readers (bench/publish_jobs.py) in a process of their own with
    `tree`'s client: a tree's worker is measured with the client of its version (a reader of this
    tree's stream() waits for events an older worker does not publish)."""
    params = {
        "queue": QUEUE,
        "mode": mode,
        "jobs": args.jobs,
        "tokens": args.tokens,
        "per_job_jobs": args.per_job_jobs,
        "producers": args.producers,
        "stream_option": has_stream_option(tree),
    }
    command = [sys.executable, str(JOBS), str(tree), url, str(out), json.dumps(params)]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def wait_ready(jobs: subprocess.Popen, tree: Path, worker: subprocess.Popen) -> None:
    """Until the producers' process has seen the worker and warmed it up; it must run `tree`'s client."""
    line = jobs.stdout.readline()
    if not line.startswith("ready "):
        alive = "running" if worker.poll() is None else f"exited {worker.returncode}"
        raise RuntimeError(f"the producers did not start (the worker: {alive}): {line!r}")
    client = Path(json.loads(line.removeprefix("ready "))["client"])
    assert client.is_relative_to(tree), f"the producers of {tree} run the client at {client}"


def run_jobs(jobs: subprocess.Popen) -> None:
    """The case's jobs, from the go to their end (the producers' process then writes its figures)."""
    jobs.stdin.write("go\n")
    jobs.stdin.flush()
    if jobs.stdout.readline().strip() != "done":
        raise RuntimeError("the producers failed")


def has_stream_option(tree: Path) -> bool:
    at = subprocess.run(["git", "-C", str(tree), "merge-base", "--is-ancestor", STREAM_OPTION, "HEAD"])
    return at.returncode == 0


def token_delays(
    arrivals: dict[str, list[tuple[float, float]]],
    starts: dict[str, float],
    samples: dict[str, list[float]],
) -> list[tuple[float, float]]:
    """Each token's time from its sampling (the worker's step end) to Redis (its event's id, to
    the millisecond) and to its reader, for the tokens sampled once the reader was reading (a reader
    that starts late sees the earlier ones at once)."""
    delays = []
    for job_id, times in arrivals.items():
        sampled = samples.get(job_id, [])[-len(times) :]
        delays.extend((w - s, a - s) for (w, a), s in zip(times, sampled) if s >= starts[job_id])
    return delays


def report(case: Case) -> None:
    unit = case.unit
    tqdm.write(
        f"[{case.tree} {case.mode}] {case.units} {unit}s in {case.wall_s:.2f}s ({case.units / case.wall_s:,.0f} {unit}s/s): "
        f"worker {case.per_unit_us(case.worker_cpu_s):.2f} us/{unit} (the engine's steps "
        f"{case.per_unit_us(case.engine_cpu_s):.2f}, the loop thread {case.per_unit_us(case.loop_cpu_s):.2f}, "
        f"{case.worker_sys_share:.0%} in the kernel), redis-server {case.per_unit_us(case.redis_cpu_s):.2f} us/{unit} "
        f"({case.redis_sys_share:.0%} of it in the kernel)"
    )
    stalls = case.stalls()
    periods = case.probe.get("periods") or [0.0]
    tqdm.write(
        f"  steps {case.probe.get('steps')}, publication stall per step: max {max(stalls) * 1e3:.2f} ms, "
        f"p99 {pct(stalls, 99) * 1e3:.2f} ms, mean {sum(stalls) / len(stalls) * 1e3:.3f} ms; "
        f"loop time between steps p50 {pct(case.probe.get('gaps') or [0], 50) * 1e3:.2f} ms; step period "
        f"p50 {pct(periods, 50) * 1e3:.2f} ms, p99 {pct(periods, 99) * 1e3:.2f} ms, max {max(periods) * 1e3:.2f} ms"
    )
    if case.delays:
        for at, name in ((0, "Redis"), (1, "reader")):
            d = [delay[at] for delay in case.delays]
            tqdm.write(
                f"  token delay sampled -> {name}: p50 {pct(d, 50) * 1e3:.1f} ms, p99 {pct(d, 99) * 1e3:.1f} ms, "
                f"max {max(d) * 1e3:.1f} ms ({len(d)} tokens)"
            )
    if case.mode.startswith("streamed"):
        calls = {name: case.commands.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("xadd", "xread")}
        tqdm.write(
            f"  per {unit}: {calls['xadd'] / case.units:.3f} events written (XADD), "
            f"{calls['xread'] / case.units:.3f} reads of them (XREAD: a blocked reader's wake and its next read)"
        )
    if case.mode.startswith("whole"):
        calls = {name: case.commands.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("xadd", "hmget")}
        tqdm.write(
            f"  {calls['xadd']:,} entries written (XADD: events, done), {calls['hmget']:,} reads of a job's hash "
            f"(HMGET: in each claim and publication, and each look at a running job)"
        )
    top = sorted(case.commands.items(), key=lambda kv: -kv[1]["usec"])[:6]
    tqdm.write(
        "  redis commands: "
        + ", ".join(
            f"{name.removeprefix('cmdstat_')} {v['calls']:,} calls {v['usec'] / case.units:.2f} us/{unit}"
            for name, v in top
        )
    )


def compare(cases: list[Case]) -> None:
    by = {}
    for case in cases:
        by.setdefault((case.mode, case.tree), []).append(case)
    for mode in dict.fromkeys(c.mode for c in cases):
        old, new = by.get((mode, "baseline"), []), by.get((mode, "new"), [])
        if not (old and new):
            continue
        for what in ("worker", "redis"):
            o = min(c.per_unit_us(getattr(c, f"{what}_cpu_s")) for c in old)
            n = min(c.per_unit_us(getattr(c, f"{what}_cpu_s")) for c in new)
            print(f"{mode:9} {what:7} CPU per {old[0].unit}: baseline {o:8.2f} us, new {n:8.2f} us: {o / n:6.1f}x less")
        o = min(c.per_unit_us(c.worker_cpu_s - c.engine_cpu_s) for c in old)
        n = min(c.per_unit_us(c.worker_cpu_s - c.engine_cpu_s) for c in new)
        print(f"{mode:9} worker CPU per {old[0].unit} less the engine's steps: baseline {o:8.2f} us, new {n:8.2f} us")
        o = max(c.units / c.wall_s for c in old)
        n = max(c.units / c.wall_s for c in new)
        print(f"{mode:9} rate: baseline {o:,.0f}, new {n:,.0f} {old[0].unit}s/s: {n / o:.1f}x")


if __name__ == "__main__":
    main()
