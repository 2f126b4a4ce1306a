"""Tenant B's queue wait behind tenant A's flex flood (bench/tenants.py's isolation target), for
several source trees in one run: per round, for each tree in turn, an echo worker started from
that tree on a queue of its own, B's probes with A absent, then A's flood in the flex lane and B's
probes behind it, then the flood cancelled; and how fast A's jobs were served meanwhile. Alternating the trees in each round puts them under
the same load of the machine, which moves these latencies more than most changes do.

    python -m bench.isolation_ab --flood 20000 --rounds 3 --probes 200 base=/path/to/tree new=$PWD
    python -m bench.isolation_ab --device-step-ms 12 --device-step-model batch ... base=... new=...

With --device-step-ms each tree's echo worker is paced like a GPU (bench/device_pace.py), a run of
each tree for each --device-step-model in every round; without it the echo steps are the worker's
CPU alone.

Each tree runs with its own `.venv/bin/python` if it has one (else this interpreter) and its own
directory first on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import os
import uuid
from pathlib import Path

from bench.device_pace import DeviceStep
from bench.measure import pct
from bench.tenants import (
    QUEUE,
    FloodRanOut,
    add_device_step_options,
    device_steps,
    flex_flood_run,
    isolation_verdict,
    paced_worker,
)
from harness.processes import start_worker
from worker.embedded_redis import EmbeddedRedis, free_port


def main() -> None:
    args = parse_args()
    trees = dict(tree.split("=", 1) for tree in args.trees)
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(
        f"A floods {args.flood} flex jobs; B submits {args.probes} default jobs, one every 50 ms (wait: to the "
        "admission; first token: to its first token in Redis)"
    )
    with EmbeddedRedis(port=free_port()) as server:
        for round_ in range(args.rounds):
            for step in device_steps(args) or [None]:
                print(f"round {round_}, echo steps {step.describe() if step else 'of the worker CPU alone'}:")
                for name, tree in trees.items():
                    print(f"  {name}: {one_run(server.url, Path(tree), step, args)}", flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--flood", type=int, default=20_000, help="tenant A's flex jobs")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--probes", type=int, default=40, help="tenant B's jobs per measurement")
    add_device_step_options(p)
    p.set_defaults(device_step_ms=0.0)  # the CPU-paced echo unless asked
    p.add_argument("trees", nargs="+", help="NAME=DIRECTORY of a source tree to run the worker from")
    return p.parse_args()


def one_run(url: str, tree: Path, step: DeviceStep | None, args: argparse.Namespace) -> str:
    queue = f"{QUEUE}-{uuid.uuid4().hex[:6]}"
    worker = paced_worker(url, queue, step, tree) if step else start_worker(url, queue, tree=tree)
    try:
        idle, behind, served = flex_flood_run(url, queue, args.flood, args.probes, worker)
    except FloodRanOut as e:  # one tree's run on a loaded machine: the others' still count
        return f"not counted: {e}"
    return (
        f"B's wait {against_idle(behind['wait'], idle['wait'])}, "
        f"{isolation_verdict(behind['wait'], idle['wait'])}; B's first token "
        f"{against_idle(behind['ttft'], idle['ttft'])}; A's jobs served meanwhile {served:.0f}/s; "
        f"load {os.getloadavg()[0]:.1f}"
    )


def against_idle(behind: list[float], idle: list[float]) -> str:
    return (
        f"with A absent p50 {pct(idle, 50) * 1e3:.1f} ms, p99 {pct(idle, 99) * 1e3:.1f} ms, behind A's flex flood "
        f"p50 {pct(behind, 50) * 1e3:.1f} ms, p99 {pct(behind, 99) * 1e3:.1f} ms ({pct(behind, 99) / pct(idle, 99):.1f}x)"
    )


if __name__ == "__main__":
    main()
