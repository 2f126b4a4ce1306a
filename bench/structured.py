"""Structured outputs' cost: decode throughput with a JSON schema on every request against none,
in the same run, at batch 16 and 64, and the host time per step that the masks add.

One engine serves both. For each batch size, round after round, it keeps `batch` requests of
random prompts running (continuous batching: one that ends is replaced at once), every request
either free (`ignore_eos`) or held to SCHEMA (an object of twelve fields: strings, integers,
numbers, enums, booleans and arrays, in turn), each cut at `--tokens` output tokens, which the
schema's JSON outgrows: both modes run the same number of requests of the same lengths. After a
warm-up of one generation of requests it times `--steps` steps. Rounds alternate free and
constrained so both meet the same machine; the figures are medians over rounds.

Per step: wall and process CPU time (every thread: the model's, the mask thread's), and the ratio
of constrained to free throughput. Then where the masks' cost lies, as CPU time of the thread that
spends it (the machine may be shared: a thread's CPU time does not count the waits that others'
load causes): the host time they add to the loop, which is its work in the masks' bookkeeping
(filling the rows the mask thread did not foresee, `batch_mask`; handing it the next step's work,
`prefill`) and in the reader (the free run's reading subtracted); the mask thread's own, which
overlaps the loop (consuming each token, filling each row); and the masking kernel's (`apply`:
device work on a GPU, the host's on CPU).

    python -m bench.structured                                   # tiny on CPU, batch 16 and 64
    python -m bench.structured --model qwen3-0.6b --device cuda  # on a GPU
    python -m bench.structured --batches 4 --steps 8 --rounds 1  # a quick rehearsal
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time

import torch

from producer_client.schema import SamplingParams
from worker.engine import Engine

FIELD_TYPES = (
    {"type": "string", "maxLength": 12},
    {"type": "integer", "minimum": 0, "maximum": 1000},
    {"enum": ["admin", "user", "guest", "owner"]},
    {"type": "boolean"},
    {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    {"type": "number", "minimum": -100, "maximum": 100},
)
SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": FIELD_TYPES[i % len(FIELD_TYPES)] for i in range(12)},
    "required": [f"field_{i}" for i in range(12)],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": SCHEMA}}
PROMPT_TOKENS = 32
PHASES = ("batch_mask", "prefill", "read", "mask_thread", "apply")


class PhaseTimer:
    """The CPU time of the calling thread spent in wrapped methods, by phase."""

    def __init__(self):
        self.totals = dict.fromkeys(PHASES, 0.0)

    def wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                self.totals[phase] += time.thread_time() - start

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.totals = dict.fromkeys(PHASES, 0.0)


class Workload:
    """Keeps `batch` requests of one mode running: each that ends is replaced at once."""

    def __init__(self, engine: Engine, batch: int, constrained: bool, tokens: int, rng: random.Random):
        self.engine = engine
        self.rng = rng
        self.params = SamplingParams(
            temperature=0,
            max_tokens=tokens,
            ignore_eos=not constrained,
            response_format=FORMAT if constrained else None,
        )
        self.ids = (f"r{rng.getrandbits(48):x}-{n}" for n in itertools.count())
        self.live = set()
        for _ in range(batch):
            self._add()

    def step(self) -> int:
        """One engine step; the output tokens it produced."""
        tokens = 0
        for out in self.engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                assert out.finish_reason == "length", (out.finish_reason, out.error)
                self.live.discard(out.request_id)
                self._add()
        return tokens

    def close(self) -> None:
        for request_id in self.live:
            self.engine.abort(request_id)
        while self.engine.has_unfinished():
            self.engine.step()

    def _add(self) -> None:
        request_id = next(self.ids)
        prompt = [self.rng.randrange(self.engine.vocab_size) for _ in range(PROMPT_TOKENS)]
        self.engine.add_request(request_id, prompt, self.params)
        self.live.add(request_id)


def measure(engine: Engine, timer: PhaseTimer, batch: int, constrained: bool, args, rng: random.Random) -> dict:
    work = Workload(engine, batch, constrained, args.tokens, rng)
    for _ in range(args.tokens + 2):  # one generation of requests: the batch's ages spread out
        work.step()
    sync(engine)
    timer.reset()
    walls, cpus, tokens = [], [], 0
    for _ in range(args.steps):
        wall, cpu = time.perf_counter(), time.process_time()
        tokens += work.step()
        sync(engine)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    work.close()
    return {
        "wall_ms": 1000 * statistics.median(walls),
        "cpu_ms": 1000 * statistics.median(cpus),
        "tokens_per_s": tokens / sum(walls),
        **{k: 1000 * v / args.steps for k, v in timer.totals.items()},
    }


def sync(engine: Engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def run(args) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    engine = Engine.from_pretrained(
        args.model,
        device=args.device,
        dtype=dtype,
        max_running=max(args.batches),
        num_pages=args.num_pages,
    )
    start = time.perf_counter()
    engine.grammars.prepare().result()
    print(f"vocabulary tables: {time.perf_counter() - start:.2f} s (once per worker, on the compile thread)")
    engine.warm_up()
    timer = PhaseTimer()
    for name in ("batch_mask", "prefill", "apply"):
        timer.wrap(engine.masks, name, name)
    timer.wrap(engine.masks, "_advance_and_fill", "mask_thread")
    timer.wrap(engine.reader, "read", "read")
    rng = random.Random(0)
    warm = Workload(engine, 1, True, 2, rng)  # the schema compiles outside the timing
    while not engine.stats().grammar_compiles:
        warm.step()
    warm.close()
    stats = engine.stats()
    print(f"schema compile: {1000 * stats.grammar_compile_seconds:.1f} ms ({stats.grammar_compiles} compile)")
    print(
        f"{args.model} on {args.device}: {args.tokens}-token requests, {args.steps} steps per round, "
        f"{args.rounds} rounds, medians"
    )
    print(
        f"{'batch':>5} | {'free ms/step':>12} {'CPU ms':>7} {'tok/s':>7} | {'schema ms/step':>14} {'CPU ms':>7} "
        f"{'tok/s':>7} | {'ratio':>5} | {'host ms added':>13} {'(fill':>6} {'handoff':>7} {'reader)':>7} | "
        f"{'mask thread ms':>14} | {'apply ms':>8}"
    )
    summaries = []
    for batch in args.batches:
        rounds = {False: [], True: []}
        for _ in range(args.rounds):
            for constrained in (False, True):
                rounds[constrained].append(measure(engine, timer, batch, constrained, args, rng))
        free, schema = (median_of(rounds[c]) for c in (False, True))
        reader = schema["read"] - free["read"]
        host = schema["batch_mask"] + schema["prefill"] + reader
        print(
            f"{batch:>5} | {free['wall_ms']:>12.2f} {free['cpu_ms']:>7.2f} {free['tokens_per_s']:>7.0f} | "
            f"{schema['wall_ms']:>14.2f} {schema['cpu_ms']:>7.2f} {schema['tokens_per_s']:>7.0f} | "
            f"{schema['tokens_per_s'] / free['tokens_per_s']:>5.3f} | {host:>13.3f} {schema['batch_mask']:>6.3f} "
            f"{schema['prefill']:>7.3f} {reader:>7.3f} | {schema['mask_thread']:>14.3f} | {schema['apply']:>8.3f}",
            flush=True,
        )
        summaries.append(
            f"batch {batch}: throughput with a schema / without = {schema['tokens_per_s'] / free['tokens_per_s']:.3f}, "
            f"CPU per step = {schema['cpu_ms'] / free['cpu_ms']:.3f}x, host time added = {host:.3f} ms per step"
        )
    print("\n".join(summaries))


def median_of(results: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[16, 64])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=40, help="output tokens of each request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-pages", type=int, default=2048)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (the tests' workers run 1; 0: torch's default)"
    )
    run(ap.parse_args())


if __name__ == "__main__":
    main()
