"""MILI beside other Python Redis job queues (issue 43): Dramatiq, taskiq, arq and Celery, each its
published package with its documented worker and result backend, all on the same redis-server.

A job is a no-op task of one short string argument that returns a short string (MILI: an echo job
of max_tokens=1, `--model echo`), its result read back by the producer through the library's
documented result API; the latency and load runs submit and wait by the library's one documented
call for both where it has one (MILI's `generate`: one round trip for a job placed on a worker's
stream; none of the peers documents such a call), and the submit run times its submit alone
(bench/peer_queues/producer.py). Every library gets 2 worker processes (LIBRARIES says with which knobs),
the same producers (threads, or asyncio tasks where the library's client is async), and a fresh
redis-server (the same binary and config, TCP on 127.0.0.1) for each of its runs; rounds
interleave the libraries (A B C D E, A B C D E, ...) and the table gives each figure's median over
the rounds, with MILI's ratio to the best peer in each column. One run of one library:

  1. submit, no worker running: wall and CPU time per submit, and the function calls of one; run
     twice, the producer kept to one CPU and redis-server kept to the same CPU, then to another
     (`submit_cpus` says why); then `--count-submits` more under callgrind, unpinned: the producer
     process's instructions a submit (every thread's), a figure the machine's load does not move;
  2. latency at low load: one producer waiting for each result before the next; the added latency
     is its p50 (p99) less the p50 (p99) of the same job run in-process (the no-op);
  3. load: `--procs` processes x `--producers` producers for `--seconds`: jobs/s end to end; CPU
     per job of the producers, of the workers (every process of their trees) and of redis-server;
     Redis memory per finished job kept: `used_memory` less the clients' buffers, KEPT_AFTER_S
     after the last results have landed, the same wait for every library (none expires a result
     by then: Dramatiq keeps one 10 minutes, arq and MILI an hour, Celery a day, taskiq for ever;
     MILI's short-lived `done` streams have gone), and `at once`, half a second after.

After the rounds: one load run of MILI with 16-token jobs (issue 43's memory target is for those),
and one more load run of MILI with every Redis command logged (SLOWLOG), for the map of where its
Redis time per job goes, script by script; then the target rows of issue 43, met or missed.

The peers run from their own environments, .venv-peers/<library>, made on first use from
bench/peer_queues/requirements/<library>.txt (pip, from PyPI); MILI runs from the project's.

    python -m bench.peers [--rounds 3 --seconds 3 --latency-jobs 200 --submit-jobs 2000 --procs 2 --producers 8]
    python -m bench.peers --only mili dramatiq --rounds 5
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.instructions import VALGRIND, control, last_dump
from bench.peer_queues.job import MAX_TOKENS_VARIABLE, POLL_VARIABLE, URL_VARIABLE
from bench.peer_queues.processes import ProducerProcess, WorkerGroup, pinned
from bench.peer_queues.redis_costs import RedisCosts, script_costs, slowlog_everything
from bench.peer_queues.report import print_breakdown, print_commands, print_table, print_targets
from producer_client.keys import DONE_TTL_MS
from worker.embedded_redis import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parents[1]
PEER_ENVS = ROOT / ".venv-peers"
REQUIREMENTS = ROOT / "bench" / "peer_queues" / "requirements"


@dataclass(frozen=True)
class Library:
    name: str
    workers: Callable[[str, str], list[list[str]]]  # (its Python, Redis URL) -> its worker processes' commands
    knobs: str  # its concurrency, as the table's notes state it
    env: dict[str, str] = field(default_factory=dict)
    app: str = ""  # its module bench.peer_queues.<app>_app: its name unless given

    @property
    def app_name(self) -> str:
        return self.app or self.name

    @property
    def own_environment(self) -> bool:
        return self.name != "mili"


def mili_workers(python: str, url: str) -> list[list[str]]:
    serve = [python, "-m", "worker", "serve", "--model", "echo", "--redis", url, "--queue", "bench"]
    quiet = ["--metrics-port", "0", "--metrics-host", "127.0.0.1", "--log-level", "WARNING"]
    return [[*serve, "--name", f"bench-worker-{i}", *quiet] for i in range(2)]


LIBRARIES = (
    Library("mili", mili_workers, "2 `worker serve --model echo` processes, each taking a batch (defaults)"),
    Library(
        "dramatiq",
        lambda py, _: [[py, "-m", "dramatiq", "bench.peer_queues.dramatiq_app", "--processes", "2"]],
        "`dramatiq --processes 2`, 8 threads each (its default)",
    ),
    Library(
        "taskiq",
        lambda py, _: [[py, "-m", "taskiq", "worker", "bench.peer_queues.taskiq_app:broker", "--log-level", "WARNING"]],
        "`taskiq worker`: 2 processes (its default), up to 100 async tasks each (its default)",
    ),
    Library(
        "arq",
        lambda py, _: [[py, "-m", "arq", "bench.peer_queues.arq_app.WorkerSettings"]] * 2,
        "2 `arq` processes, up to 10 jobs each (max_jobs, its default)",
    ),
    Library(
        "celery",
        lambda py, _: [
            [py, "-m", "celery", "-A", "bench.peer_queues.celery_app", "worker", "--concurrency", "2"]
            + ["--loglevel", "WARNING", "--without-gossip", "--without-mingle", "--without-heartbeat"]
        ],
        "`celery worker --concurrency 2`: prefork (its default pool) of 2 children, prefetch multiplier 4 (its "
        "default); without gossip, mingle and heartbeat (events between workers, which no job here needs)",
    ),
)
MILI_16_TOKENS = Library("mili-16", mili_workers, "as mili; 16-token jobs", {MAX_TOKENS_VARIABLE: "16"}, "mili")


def main() -> None:
    args = parse_args()
    libraries = [lib for lib in LIBRARIES if lib.name in args.only]
    pythons = {lib.name: environment(lib) for lib in libraries}
    print_setup(libraries, args)
    runs: dict[str, list[dict]] = {lib.name: [] for lib in libraries}
    for round_ in range(1, args.rounds + 1):
        for lib in libraries:
            runs[lib.name].append(timed(lib, pythons[lib.name], args, f"round {round_}/{args.rounds}"))
    if "mili" in pythons:
        runs[MILI_16_TOKENS.name] = [timed(MILI_16_TOKENS, pythons["mili"], args, "once", full=False)]
    table = {name: medians(figures) for name, figures in runs.items()}
    print_table(table, args.rounds)
    print_targets(table)
    print_commands({name: figures[-1]["commands"] for name, figures in runs.items()})
    if "mili" in pythons:
        print_breakdown(script_breakdown(pythons["mili"], args), table["mili"].get("redis_cpu_us"))
    print(f"\nload average at the end: {load_average()}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0, help="length of each load run")
    p.add_argument("--procs", type=int, default=2, help="producer processes in a load run")
    p.add_argument("--producers", type=int, default=8, help="producers per process (threads, or asyncio tasks)")
    p.add_argument("--latency-jobs", type=int, default=200, help="jobs of the low-load latency run")
    # 2,000: a process's first few hundred submits run slower (caches, allocator), and 200 of them,
    # some 30 ms, swung MILI's figure by 20% from run to run (bench/RESULTS.md, the producer's cost).
    p.add_argument("--submit-jobs", type=int, default=2000, help="submits timed with no worker running")
    p.add_argument(
        "--count-submits", type=int, default=200, help="submits counted under callgrind, no worker running (0: none)"
    )
    p.add_argument("--poll-s", type=float, default=0.001, help="arq's and taskiq's polling intervals")
    p.add_argument(
        "--only", nargs="+", default=[lib.name for lib in LIBRARIES], choices=[lib.name for lib in LIBRARIES]
    )
    return p.parse_args()


def environment(lib: Library) -> str:
    """The Python that runs `lib`: the project's for MILI; for a peer, its own environment, made
    (or made again, when its pins changed) from its requirements file."""
    if not lib.own_environment:
        return sys.executable
    venv, requirements = PEER_ENVS / lib.name, REQUIREMENTS / f"{lib.name}.txt"
    python, stamp = venv / "bin" / "python", venv / "installed-requirements.txt"
    if stamp.exists() and stamp.read_text() == requirements.read_text():
        return str(python)
    print(f"making {venv.relative_to(ROOT)}: pip install -r {requirements.relative_to(ROOT)} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "-r", str(requirements)]
    subprocess.run(pip, check=True)
    stamp.write_text(requirements.read_text())
    return str(python)


def print_setup(libraries: list[Library], args: argparse.Namespace) -> None:
    print(f"machine: {os.cpu_count()} cores, load average {load_average()} at the start")
    print(f"redis-server: {redis_version()}, TCP 127.0.0.1, a fresh server per library and round, no persistence")
    print(
        f"load: {args.procs} producer processes x {args.producers} producers for {args.seconds:g} s; latency: 1 "
        f"producer, {args.latency_jobs} jobs; submit: {args.submit_jobs} submits, no worker running"
    )
    print(f"arq's and taskiq's polling intervals: {args.poll_s * 1e3:g} ms (their defaults: 500 and 200 ms)")
    for lib in libraries:
        print(f"  {lib.name}: {lib.knobs}")
    print()


def measure(lib: Library, python: str, args: argparse.Namespace, full: bool = True) -> dict:
    """One run of `lib` on a fresh redis-server: submit, then latency and load with its workers
    (`full`), or the load alone."""
    with EmbeddedRedis(port=free_port()) as server, tempfile.TemporaryDirectory(prefix="mili-peers-") as logs:
        env = run_environment(server.url, lib, args)
        costs = RedisCosts(server)
        figures = submit_figures(python, lib, env, args, costs, server.process.pid) if full else {}
        with WorkerGroup(lib.workers(python, server.url), env, Path(logs)) as workers:
            if full:
                figures |= latency_figures(python, lib, env, args)
            figures |= load(python, lib, env, args, costs, workers)
        costs.close()
    return figures


def run_environment(url: str, lib: Library, args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **lib.env)
    return env | {URL_VARIABLE: url, POLL_VARIABLE: str(args.poll_s)}


# Where the scheduler puts redis-server decides what a submit's CPU reads, more than the code does:
# on the producer's core, the server woken by the request runs before the producer reads the reply
# (about one involuntary switch a submit), and the producer's caches stay warm; on another core, the
# producer sleeps for each reply (one voluntary switch a submit) and its core goes idle: the same
# code read about 70 and 120 us a submit (bench/RESULTS.md, "bench.peers' submit column"). Left to
# the scheduler, a run got either or a mix, which moved by half from run to run and chunk to chunk.
# The submit run is made in each, named (its figures' keys begin with SAME_CORE or APART): at a low
# load each is steadier than the mix (1.27x against 1.71x over 5 runs), not at a high one, where the
# other processes on the pinned CPU move it as much (CPU time is not a count: bench.instructions).
SAME_CORE, APART = "submit_", "apart_submit_"


def submit_cpus() -> dict[str, tuple[set[int], set[int]]]:
    """Figure prefix -> (the producer's CPUs, redis-server's) of each submit run this machine allows."""
    cpus = sorted(os.sched_getaffinity(0))
    producer, other = {cpus[0]}, {cpus[-1]}
    return {SAME_CORE: (producer, producer)} | ({APART: (producer, other)} if other != producer else {})


def submit_figures(
    python: str, lib: Library, env: dict, args: argparse.Namespace, costs: RedisCosts, server_pid: int
) -> dict:
    figures = {}
    for prefix, (producer, server) in submit_cpus().items():
        with pinned(server_pid, server):
            argv = ["submit", "--jobs", str(args.submit_jobs)]
            run = ProducerProcess.one_run(python, lib.app_name, env, argv, producer)
        figures |= {prefix + key.removeprefix(SAME_CORE): value for key, value in run.items()}
        costs.redis.flushall()  # each run, and the workers after them, start on an empty server
    if args.count_submits:
        figures["submit_instructions"] = submit_instructions(python, lib, env, args.count_submits)
        costs.redis.flushall()
    return figures


def submit_instructions(python: str, lib: Library, env: dict, jobs: int) -> float:
    """The producer process's instructions a submit (every thread's), counted by callgrind from the
    go to its last submit's end, after its warm-up (as bench.instructions counts MILI's)."""
    with tempfile.TemporaryDirectory(prefix="mili-peers-callgrind-") as out:
        under = (*VALGRIND, "-q", f"--callgrind-out-file={out}/producer.%p.out")
        producer = ProducerProcess(python, lib.app_name, env, ["count", "--jobs", str(jobs)], under=under)
        producer.expect()  # warmed up
        control("-z", producer.process.pid)
        producer.send()
        submits = producer.expect()["submits"]
        control("-d", producer.process.pid)
        producer.finish()
        return last_dump(out, producer.process.pid) / submits


def latency_figures(python: str, lib: Library, env: dict, args: argparse.Namespace) -> dict:
    """One producer waiting for each result: what the queue adds to the job run in-process."""
    jobs = str(args.latency_jobs)
    run = ProducerProcess.one_run(python, lib.app_name, env, ["load", "--jobs", jobs, "--direct", jobs])
    added = {f"added_p{q}_ms": (run[f"latency_p{q}"] - run[f"direct_p{q}"]) * 1e3 for q in (50, 99)}
    return added | {"producer_cpu_low_load_us": run["cpu_s"] / run["jobs"] * 1e6}


def start_load(python: str, lib: Library, env: dict, args: argparse.Namespace) -> list[ProducerProcess]:
    """The load's producer processes, connected and warmed up, waiting for the go."""
    command = ["load", "--producers", str(args.producers), "--seconds", str(args.seconds)]
    producers = [ProducerProcess(python, lib.app_name, env, command) for _ in range(args.procs)]
    for producer in producers:
        producer.expect()
    return producers


def run_load(producers: list[ProducerProcess]) -> tuple[int, float, float]:
    """Go, and wait for every producer's end: jobs done, the longest elapsed time, producers' CPU."""
    for producer in producers:
        producer.send()
    parts = [producer.expect() for producer in producers]
    return sum(p["jobs"] for p in parts), max(p["elapsed_s"] for p in parts), sum(p["cpu_s"] for p in parts)


# What a finished job keeps is measured past the transient: MILI's done stream of each job lives
# DONE_TTL_MS after its end (the worker then deletes it), while a load run lasts a few seconds.
# The baseline before the load run waits as long, for the latency run's jobs.
KEPT_AFTER_S = DONE_TTL_MS / 1000 + 2


def load(
    python: str, lib: Library, env: dict, args: argparse.Namespace, costs: RedisCosts, workers: WorkerGroup
) -> dict:
    """The load run: CPU and commands counted from the go to the last result, memory once the
    workers' last writes have landed, with the producers still connected."""
    producers = start_load(python, lib, env, args)
    pids = workers.pids()
    time.sleep(KEPT_AFTER_S)  # the latency run's transients gone: the baseline is what it kept
    cpu0, stats0, memory0 = (workers.cpu(pids), costs.cpu()), costs.commandstats(), costs.kept_memory()
    jobs, elapsed, producers_cpu = run_load(producers)
    cpu1, stats1 = (workers.cpu(pids), costs.cpu()), costs.commandstats()
    time.sleep(0.5)
    at_once = costs.kept_memory()
    time.sleep(KEPT_AFTER_S - 0.5)
    memory1 = costs.kept_memory()
    for producer in producers:
        producer.finish()
    return {
        "jobs_per_s": jobs / elapsed,
        "producer_cpu_us": producers_cpu / jobs * 1e6,
        "worker_cpu_us": (cpu1[0] - cpu0[0]) / jobs * 1e6,
        "redis_cpu_us": (cpu1[1] - cpu0[1]) / jobs * 1e6,
        "memory_per_job": (memory1 - memory0) / jobs,
        "memory_at_once": (at_once - memory0) / jobs,
        "commands": costs.per_job(stats0, stats1, jobs),
    }


def script_breakdown(python: str, args: argparse.Namespace) -> dict:
    """MILI's Redis time per job by command and by script, from a load run of its own (the
    slowlog costs Redis time: the table's runs are kept clear of it)."""
    lib = LIBRARIES[0]
    with EmbeddedRedis(port=free_port()) as server, tempfile.TemporaryDirectory(prefix="mili-peers-") as logs:
        env = run_environment(server.url, lib, args)
        costs = RedisCosts(server)
        with WorkerGroup(lib.workers(python, server.url), env, Path(logs)):
            producers = start_load(python, lib, env, args)
            with slowlog_everything(costs.redis):
                jobs = run_load(producers)[0]
                entries = costs.redis.slowlog_get(-1)
            for producer in producers:
                producer.finish()
        costs.close()
    return script_costs(entries, jobs)


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0] if key != "commands"}


def timed(lib: Library, python: str, args: argparse.Namespace, label: str, full: bool = True) -> dict:
    """One run of `lib`, with a line of its figures."""
    start = time.monotonic()
    figures = measure(lib, python, args, full)
    added = f"added p50 {figures['added_p50_ms']:6.2f} ms, {submit_line(figures)}" if full else "load only"
    print(
        f"{label:11} {lib.name:9} {figures['jobs_per_s']:7,.0f} jobs/s, {added}, "
        f"CPU/job producers {figures['producer_cpu_us']:4.0f} workers {figures['worker_cpu_us']:4.0f} Redis "
        f"{figures['redis_cpu_us']:4.0f} us, {figures['memory_per_job']:6,.0f} B/job kept ({figures['memory_at_once']:,.0f} at once) "
        f"({time.monotonic() - start:.0f} s; load average {load_average()})",
        flush=True,
    )
    return figures


def submit_line(figures: dict) -> str:
    """A submit's CPU in each placement: over all the timed submits (the lowest-highest of its parts)."""
    parts = [
        f"{figures[prefix + 'cpu_us']:.0f} ({figures[prefix + 'cpu_low_us']:.0f}-{figures[prefix + 'cpu_high_us']:.0f})"
        for prefix in (SAME_CORE, APART)
        if prefix + "cpu_us" in figures
    ]
    counted = f", {figures['submit_instructions']:,.0f} instructions" if "submit_instructions" in figures else ""
    return "submit CPU " + " / ".join(parts) + f" us (Redis on its core / another){counted}"


def load_average() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def redis_version() -> str:
    from worker.embedded_redis import redis_server_binary

    return subprocess.run(
        [redis_server_binary(), "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[2]


if __name__ == "__main__":
    main()
