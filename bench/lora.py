"""LoRA adapters beside the base model alone, in one run (issue 46's targets).

`step`: the decode step of a full batch whose rows are spread over `--adapters` adapters of rank
`--rank` (every projection adapted), against the same batch on an engine without adapters: two
engines over the same checkpoint, filled alike, their steps timed in turns (so that a neighbour's
load on a shared machine falls on both), median of each. Then what an adapter costs to load: the
read from disk on the loader thread, and the install into a device slot on the engine's thread;
and the steps that ran while an adapter was being read (the loader thread holds no step back).

    python -m bench.lora step --model small --batch 64 --adapters 8 --rank 16     # CPU target
    python -m bench.lora step --model qwen3-0.6b --batch 64                         # GPU target

`placement`: jobs on 50 adapters placed over 4 workers, beside the shared stream and one worker
(bench/lora_placement.py says how).

    python -m bench.lora placement
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import lora_placement
from bench.offline import PROMPT_ID_LIMIT
from producer_client.schema import SamplingParams
from worker.engine import Engine
from worker.model.config import read_json
from worker.model.presets import resolve_model_path
from worker.model.random_adapter import write_random_adapter


def write_adapters(model: str, names: list[str], rank: int, directory: Path) -> None:
    """Random adapters of `rank` on every projection of `model`, in `directory` by name."""
    config = read_json(resolve_model_path(model) / "config.json")
    for seed, name in enumerate(names):
        write_random_adapter(directory / name, config, rank, seed=seed, dtype=torch.float32)


def fill(engine: Engine, batch: int, context: int, max_tokens: int, adapters: list[str | None]) -> None:
    """Admits the batch, row i on adapters[i % len], and steps until every row decodes."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(PROMPT_ID_LIMIT) for _ in range(context)]
        engine.add_request(f"decode-{i}", prompt, params, adapter=adapters[i % len(adapters)])
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)


def timed_step(engine: Engine) -> float:
    sync(engine)
    start = time.perf_counter()
    engine.step()
    sync(engine)
    return time.perf_counter() - start


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def step_ratio(args: argparse.Namespace) -> float:
    """Prints the two engines' decode step times and their ratio; returns the ratio."""
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [f"lora-{i}" for i in range(args.adapters)]
        write_adapters(args.model, [*adapters, "late"], args.rank, Path(tmp))
        common = {"device": args.device, "dtype": args.dtype, "max_running": args.batch, **kv_settings(args)}
        base = Engine.from_pretrained(args.model, **common)
        # A slot more than the batch's adapters: for the one read while the batch runs.
        lora = Engine.from_pretrained(
            args.model, **common, lora_dir=tmp, max_loras=args.adapters + 1, max_lora_rank=args.rank
        )
        max_tokens = args.warmup + args.steps + 8
        fill(base, args.batch, args.context, max_tokens, [None])
        fill(lora, args.batch, args.context, max_tokens, adapters)
        for _ in range(args.warmup):
            base.step(), lora.step()
        times = {"base": [], "lora": []}
        for _ in range(args.steps):
            times["base"].append(timed_step(base))
            times["lora"].append(timed_step(lora))
        base_ms, lora_ms = (statistics.median(times[k]) * 1e3 for k in ("base", "lora"))
        ratio = lora_ms / base_ms
        print(
            f"machine: {os.cpu_count()} cores, {torch.get_num_threads()} torch threads, load average {os.getloadavg()[0]:.2f}"
        )
        print(
            f"{args.model} on {args.device} ({lora.runner.model.model.norm.weight.dtype}): decode step of batch "
            f"{args.batch} (context {args.context}), median of {args.steps}, the two engines' steps in turns; "
            f"decode CUDA graphs {'on' if lora.runner.decode_graphs else 'off'}"
        )
        print(f"base model alone:                        {base_ms:8.2f} ms")
        print(f"{args.adapters} adapters of rank {args.rank} over the batch: {lora_ms:8.2f} ms = {ratio:.3f}x the base")
        print_load_times(lora)
        print_steps_while_reading(lora, args.adapters)
        base.close(), lora.close()
    return ratio


def print_load_times(engine: Engine) -> None:
    loader, slots = engine.lora.loader, engine.lora.slots
    print(
        f"adapter load: read from disk {loader.read_seconds / loader.reads * 1e3:.1f} ms each on the loader thread "
        f"({loader.reads} reads); installed in a slot {slots.install_seconds / slots.installs * 1e3:.2f} ms each "
        f"on the engine's thread ({slots.installs} installs)"
    )


def print_steps_while_reading(engine: Engine, reads_before: int) -> None:
    """Adds a job on an adapter nobody has read yet, and times the batch's steps until it is read."""
    engine.add_request("late", [1, 2, 3], SamplingParams(temperature=0, max_tokens=1), adapter="late")
    during = []
    while engine.lora.loader.reads <= reads_before:
        during.append(timed_step(engine))
    print(
        f"while an adapter was read: {len(during)} steps ran, median {statistics.median(during) * 1e3:.2f} ms, "
        f"longest {max(during) * 1e3:.2f} ms (the read took {engine.lora.loader.read_seconds / engine.lora.loader.reads * 1e3:.1f} ms on average)"
    )


def kv_settings(args: argparse.Namespace) -> dict:
    return {"kv_cache_mib": args.kv_cache_mib} if args.device == "cpu" else {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True)
    step = commands.add_parser("step", help="decode step time with adapters over the batch, beside the base alone")
    step.add_argument("--model", default="qwen3-0.6b" if cuda else "small")
    step.add_argument("--device", default="cuda" if cuda else "cpu")
    step.add_argument("--dtype", default=None, help="default: the checkpoint's")
    step.add_argument("--batch", type=int, default=64)
    step.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    step.add_argument("--adapters", type=int, default=8)
    step.add_argument("--rank", type=int, default=16)
    step.add_argument("--steps", type=int, default=20, help="timed steps of each engine")
    step.add_argument("--warmup", type=int, default=3)
    step.add_argument("--kv-cache-mib", type=int, default=256, help="each engine's KV pool on CPU")
    step.add_argument("--max-ratio", type=float, help="exit 1 when the ratio is above this (acceptance)")
    placement = commands.add_parser("placement", help="adapter reads per job and prefix hits, placed over workers")
    lora_placement.add_arguments(placement)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.command == "placement":
        lora_placement.main(args)
        return 0
    ratio = step_ratio(args)
    if args.max_ratio is not None and ratio > args.max_ratio:
        print(f"FAIL: {ratio:.3f}x exceeds the target {args.max_ratio}x")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
