"""Placement of jobs on LoRA adapters (issue 46's target): bench/affinity.py's multi-turn chat
trace where each chat runs on one of `--adapters` adapters (chat c on adapter c mod N), through:

  shared   N workers, placement off: every job on the shared stream, any worker runs any adapter;
  placed   N workers, placement on: a job on an adapter goes to the worker its adapter hashes to,
           within the load bound (producer_client/placement.py);
  ideal    one worker with a slot for every adapter, whose cache sees every job: the hit rate's
           ceiling (its adapters are read once each, its wall times are one worker's).

Every worker serves the adapters from one --lora-dir (random adapters of the tiny model, PEFT's
layout), with `--max-loras` device slots and `--max-cpu-loras` in host memory. Printed per
placement: adapter reads from disk per job and installs in a slot per job (the workers' counters),
the prefix cache hit rate (cached / prompt tokens, from each job's usage), computed prefill, TTFT
and jobs/s; then the targets: reads per job <= 0.1 placed, hit rate >= 0.9 x the ideal's.

    python -m bench.lora placement [--conversations 200 --turns 5 --adapters 50 --workers 4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.affinity import KEYS, Conversation, Figures, Mode, make_trace, run_mode
from worker.model.presets import PRESETS
from worker.model.random_adapter import write_random_adapter


@dataclass
class AdapterCounts:
    reads: float = 0.0
    installs: float = 0.0


def main(args: argparse.Namespace) -> None:
    trace = [
        replace(c, adapter=f"chat-{i % args.adapters}")
        for i, c in enumerate(make_trace(args.conversations, args.turns, args.groups, args.system_words, args.seed))
    ]
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(
        f"trace: {args.conversations} chats x {args.turns} turns on {args.adapters} adapters of rank {args.rank} "
        f"({args.conversations / args.adapters:.0f} chats each), {args.groups} system prompts; {args.workers} workers "
        f"of {args.max_loras} slots and {args.max_cpu_loras} adapters in host memory; model tiny\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.adapters):
            write_random_adapter(Path(tmp) / f"chat-{i}", PRESETS["tiny"].config, args.rank, seed=i)
        lora = ("--lora-dir", tmp, "--max-lora-rank", str(args.rank))
        slots = ("--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras))
        every = ("--max-loras", str(args.adapters), "--max-cpu-loras", str(args.adapters))
        runs = {
            "shared": (Mode("shared", args.workers, False), (*lora, *slots)),
            "placed": (Mode("placed", args.workers, True), (*lora, *slots)),
            "ideal": (Mode("ideal", 1, False), (*lora, *every)),
        }
        figures = {name: measured(mode, trace, args, extra) for name, (mode, extra) in runs.items()}
    print_table(figures)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")


def measured(mode: Mode, trace: list[Conversation], args, extra: tuple[str, ...]) -> tuple[Figures, AdapterCounts]:
    counts = AdapterCounts()

    def count(admin, names) -> None:
        for name in names:
            port = int(admin.hget(KEYS.worker(name), "metrics_port"))
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name == "mili_lora_adapter_reads_total":
                        counts.reads += s.value
                    elif s.name == "mili_lora_adapter_installs_total":
                        counts.installs += s.value

    return run_mode(mode, trace, args, extra, count), counts


def print_table(figures: dict[str, tuple[Figures, AdapterCounts]]) -> None:
    print(
        f"{'placement':<10} {'jobs':>5} {'reads/job':>9} {'installs/job':>12} {'hit rate':>8} "
        f"{'computed/prompt':>15} {'TTFT p50':>9} {'TTFT p99':>9} {'jobs/s':>7}  taken from"
    )
    for name, (f, counts) in figures.items():
        jobs = len(f.results)
        taken = ", ".join(f"{k} {int(v)}" for k, v in sorted(f.taken.items()) if v)
        print(
            f"{name:<10} {jobs:>5} {counts.reads / jobs:>9.3f} {counts.installs / jobs:>12.3f} {f.hit_rate:>8.3f} "
            f"{f.computed_share:>15.3f} {f.pct_of(f.ttft, 50):>8.3f}s {f.pct_of(f.ttft, 99):>8.3f}s "
            f"{jobs / f.wall_s:>7.2f}  {taken}"
        )
    (placed, placed_counts), (ideal, _) = figures["placed"], figures["ideal"]
    shared, shared_counts = figures["shared"]
    print("\ntargets (placed, same run):")
    print(
        f"  adapter reads per job        {placed_counts.reads / len(placed.results):.3f}   (target <= 0.1; "
        f"shared: {shared_counts.reads / len(shared.results):.3f})"
    )
    print(
        f"  hit rate vs ideal            {placed.hit_rate / ideal.hit_rate:.3f}   (target >= 0.9; shared: "
        f"{shared.hit_rate / ideal.hit_rate:.3f})"
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--conversations", type=int, default=200)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--adapters", type=int, default=50)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="system prompts shared by the chats")
    p.add_argument("--system-words", type=int, default=250)
    p.add_argument("--max-tokens", type=int, default=8, help="tokens of each answer")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--max-loras", type=int, default=16, help="each worker's device slots")
    p.add_argument("--max-cpu-loras", type=int, default=32, help="each worker's adapters in host memory")
    p.add_argument("--concurrency", type=int, default=16, help="chats in flight at once")
    p.add_argument("--kv-cache-mib", type=int, default=512, help="each worker's KV pool: holds the whole trace")
    p.add_argument("--steal-delay-ms", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
