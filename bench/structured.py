"""Structured outputs' cost: decode steps with a JSON schema on every request against the same
steps with none, in one run, at batch 16 and 64, and the host time per step that the masks add.

One engine serves both. For each batch size, round after round, it fills the batch with requests
of random prompts, free (`ignore_eos`) or held to SCHEMA (a list of 40 records of a name, an age,
a role and tags: keys, strings, numbers, enums and arrays in turn, and more than `--steps` tokens
long, so that no request ends while it is timed), prefills them, and times `--steps` decode steps.
Rounds alternate free and constrained so both meet the same machine; the figures are medians.

Per step: wall and process CPU time (every thread: the model's, the mask thread's), the ratio of
constrained to free throughput, and the loop's own time in the masks' bookkeeping: waiting for the
mask thread and filling the rows it did not foresee (`batch_mask`), handing it the next step's
work (`prefill`) and masking the logits (`apply`, the kernel: device work on a GPU, and the host's
on CPU). The mask thread's work (consuming each token, filling each row) overlaps the loop's.

    python bench/structured.py                                   # tiny on CPU, batch 16 and 64
    python bench/structured.py --model qwen3-0.6b --device cuda  # on a GPU
    python bench/structured.py --batches 4 --steps 8 --rounds 1  # a quick rehearsal
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

# Run as a script, this file's directory leads sys.path, and bench/queue.py would shadow the
# standard library's queue: the repository instead.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402

from producer_client.schema import SamplingParams  # noqa: E402
from worker.engine import Engine  # noqa: E402

RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 40}
FORMAT = {"type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}
PROMPT_TOKENS = 32
MASK_PHASES = ("batch_mask", "prefill", "apply")


class PhaseTimer:
    """The wall time spent in wrapped methods, by phase."""

    def __init__(self):
        self.totals = dict.fromkeys(MASK_PHASES, 0.0)

    def wrap(self, owner, name: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.totals[name] += time.perf_counter() - start

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.totals = dict.fromkeys(MASK_PHASES, 0.0)


def fill(engine: Engine, batch: int, constrained: bool, max_tokens: int, rng: random.Random) -> list[str]:
    """Adds `batch` requests and steps until every one has its first token, so all decode."""
    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=not constrained,
        response_format=FORMAT if constrained else None,
    )
    ids = [f"r{rng.getrandbits(48):x}" for _ in range(batch)]
    for request_id in ids:
        engine.add_request(request_id, [rng.randrange(engine.vocab_size) for _ in range(PROMPT_TOKENS)], params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    return ids


def measure(engine: Engine, timer: PhaseTimer, batch: int, constrained: bool, steps: int, rng: random.Random) -> dict:
    ids = fill(engine, batch, constrained, steps + 8, rng)
    sync(engine)
    timer.reset()
    walls, cpus, tokens = [], [], 0
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens += sum(len(o.new_token_ids) for o in engine.step())
        sync(engine)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    running = sum(1 for r in ids if r in engine.reader.live)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    assert running == batch, f"{batch - running} requests ended while timed: the workload is too short"
    return {
        "wall_ms": 1000 * statistics.median(walls), "cpu_ms": 1000 * statistics.median(cpus),
        "tokens_per_s": tokens / sum(walls), **{k: 1000 * v / steps for k, v in timer.totals.items()},
    }


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run(args) -> None:
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    engine = Engine.from_pretrained(
        args.model, device=args.device, dtype=dtype, max_running=max(args.batches), num_pages=args.num_pages,
    )
    engine.warm_up()
    start = time.perf_counter()
    engine.grammars.prepare().result()
    print(f"vocabulary tables: {time.perf_counter() - start:.2f} s (once per worker, on the compile thread)")
    timer = PhaseTimer()
    for name in ("batch_mask", "prefill", "apply"):
        timer.wrap(engine.masks, name)
    rng = random.Random(0)
    fill_and_drop(engine, rng)
    stats = engine.stats()
    print(f"schema compile: {1000 * stats.grammar_compile_seconds:.1f} ms ({stats.grammar_compiles} compile)")
    print(f"{args.model} on {args.device}, {args.steps} decode steps per round, {args.rounds} rounds, medians")
    header = (
        f"{'batch':>5} | {'free ms/step':>12} {'CPU ms':>7} {'tok/s':>8} | {'schema ms/step':>14} {'CPU ms':>7} "
        f"{'tok/s':>8} | {'throughput':>10} | {'host ms/step: wait+fill':>23} {'handoff':>7} {'apply':>6}"
    )
    print(header)
    for batch in args.batches:
        rounds = {False: [], True: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                rounds[constrained].append(measure(engine, timer, batch, constrained, args.steps, rng))
        free, schema = (median_of(rounds[c]) for c in (False, True))
        print(
            f"{batch:>5} | {free['wall_ms']:>12.2f} {free['cpu_ms']:>7.2f} {free['tokens_per_s']:>8.0f} | "
            f"{schema['wall_ms']:>14.2f} {schema['cpu_ms']:>7.2f} {schema['tokens_per_s']:>8.0f} | "
            f"{schema['tokens_per_s'] / free['tokens_per_s']:>10.3f} | {schema['batch_mask']:>23.3f} "
            f"{schema['prefill']:>7.3f} {schema['apply']:>6.3f}",
            flush=True,
        )


def fill_and_drop(engine: Engine, rng: random.Random) -> None:
    """One constrained request through its first token: the schema compiles outside the timing."""
    ids = fill(engine, 1, True, 4, rng)
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()


def median_of(results: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[16, 64])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-pages", type=int, default=2048)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
