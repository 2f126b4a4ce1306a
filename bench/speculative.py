"""Speculative decoding beside the same engine without it, in one run (issue 45).

Parts (`--parts`, all by default):
- verify: the model step of a batch of decodes that each verify n drafted tokens (n = 0..k, or
  `--verify-drafts`; the n in alternating rounds, medians of `--repeats`), as a multiple of the
  plain decode step: what one extra query token per request costs (and what a draft tree of n
  nodes would cost: its attention mask aside, it is the same step).
- controlled: tokens/s of `Engine.generate` at batch `--batch` with a draft that agrees with the
  target with probability p per token (the target's own greedy output, learnt from a first run,
  each drafted token right with probability p, else another token), at the p whose expected
  acceptance length (tokens per verify step) is `--acceptance-length`; with p = 0 and the engine's
  adaptive rule on (what it loses where drafts never match); and with the model drafting for
  itself (`--speculative-method draft` of the same checkpoint: every drafted token right, at a
  draft model's real cost: the ceiling).
- ngram: n-gram lookup on the target's own output where it repeats its context (a random model's
  greedy output falls into loops, which is what lookup catches; real text needs a trained model).
- stage: the GPU stage's figures (scripts/acceptance/stages/speculative.py): tokens/s with and
  without, at batches `--stage-batches`, with a draft model (`--stage-draft`) and with a random
  EAGLE-3 head in the published layout, each proposer run for its cost and its tokens then set
  right with probability p (acceptance by construction). The adaptive rule decides each step.

    python -m bench.speculative                                    # CPU: small, every part
    python -m bench.speculative --parts stage --model qwen3-0.6b --device cuda --stage-batches 1 16 64 256
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bench.decode_step import sync
from bench.offline import PROMPT_ID_LIMIT
from bench.timing import median_seconds
from producer_client.schema import SamplingParams
from worker.engine import Engine, EngineSettings
from worker.engine.kv_pool import pages_for
from worker.engine.scheduler import ScheduledChunk
from worker.model import qwen3
from worker.model.eagle3_checkpoint import write_random_eagle3_head
from worker.model.loader import load_model
from worker.model.presets import resolve_model_path
from worker.model.tokenizer import Tokenizer

PARTS = ("verify", "controlled", "ngram", "stage")


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    target = Target.load(args)
    print(f"{args.model} on {args.device} ({target.model.model.norm.weight.dtype}), k = {args.k}")
    if "verify" in args.parts:
        verify_cost(target, args)
    if "controlled" in args.parts:
        controlled(target, args)
    if "ngram" in args.parts:
        ngram(target, args)
    if "stage" in args.parts:
        stage(target, args)


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--model", default="qwen3-0.6b" if cuda else "small", help="preset name or checkpoint directory")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default=None, help="default: the checkpoint's")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--batch", type=int, default=1, help="requests of the controlled and ngram parts")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens per request")
    p.add_argument("--output", type=int, default=96, help="output tokens per request")
    p.add_argument("--acceptance-length", type=float, default=3.0, help="expected tokens per verify step")
    p.add_argument("--verify-batches", type=int, nargs="+", default=[1, 16])
    p.add_argument(
        "--verify-drafts",
        type=int,
        nargs="+",
        default=None,
        help="drafted tokens per request the verify part times (default 0..k); n query tokens cost what a tree of n nodes would",
    )
    p.add_argument("--stage-batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--stage-draft", default="tiny", help="the stage's draft model (preset or directory)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each configuration (pairs, where compared)")
    return p.parse_args()


# -- the target and its engines ------------------------------------------------------------------


@dataclass
class Target:
    path: Path
    model: torch.nn.Module
    config: object
    tokenizer: Tokenizer
    eos: list[int]
    device: torch.device

    @classmethod
    def load(cls, args: argparse.Namespace) -> Target:
        path = resolve_model_path(args.model)
        loaded = load_model(path, args.dtype, args.device)
        tokenizer = Tokenizer.from_dir(path)
        eos = list(loaded.generation_config.eos_token_ids) + list(tokenizer.eos_token_ids)
        return cls(path, loaded.model, loaded.config, tokenizer, eos, torch.device(args.device))

    def engine(self, batch: int, context: int, k: int, **settings) -> Engine:
        """An engine over the one loaded model, its pool just large enough for `batch` requests of
        `context` tokens (engines of one process must not each take the GPU's memory)."""
        pages = 2 * batch * pages_for(context + k + 1, 16) + 64
        base = {"num_pages": pages, "page_size": 16, "max_running": max(batch, 1)}
        base["max_num_batched_tokens"] = max(4096, batch * (k + 1))
        engine = Engine(
            self.model,
            self.config,
            self.tokenizer,
            EngineSettings.parse(**base, **settings),
            self.eos,
            self.device,
        )
        engine.warm_up()
        return engine


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(PROMPT_ID_LIMIT) for _ in range(length)] for _ in range(batch)]


def clock(device: torch.device) -> float:
    """Wall time on CUDA; on the CPU the process's CPU time: on a shared machine other processes
    stretch wall time, not the work a run does (the engine's threads are all this process's)."""
    return time.perf_counter() if device.type == "cuda" else time.process_time()


def generate_rate(engine: Engine, work: list[list[int]], output: int, repeats: int) -> tuple[float, list]:
    """Output tokens per second (of `clock`) of the fastest of `repeats` runs, after one untimed
    run, and the outputs."""
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    outputs = engine.generate(work, params)
    best = float("inf")
    for _ in range(repeats):
        sync(engine.device)
        start = clock(engine.device)
        outputs = engine.generate(work, params)
        sync(engine.device)
        best = min(best, clock(engine.device) - start)
    return len(work) * output / best, outputs


# -- proposers whose acceptance is set by construction ------------------------------------------


class Oracle:
    """Drafts each request's known continuation, each token right with probability `p` (a seeded
    draw per draft), else the next token id. With `inner`, the real proposer runs first, for its
    cost, and its tokens are replaced."""

    def __init__(self, outputs: dict[tuple[int, ...], list[int]], p: float, vocab: int, inner=None, seed: int = 0):
        self.outputs, self.p, self.vocab, self.inner = outputs, p, vocab, inner
        self.rng = random.Random(seed)

    def observe(self, chunks) -> None:
        if self.inner is not None:
            self.inner.observe(chunks)

    def propose(self, requests, limits) -> list[list[int]]:
        if self.inner is not None:
            self.inner.propose(requests, limits)
        drafts = []
        for req, limit in zip(requests, limits):
            known = self.outputs[tuple(req.prompt_token_ids)]
            done = req.num_output_tokens
            drafts.append([self._token(known, position) for position in range(done, done + limit)])
        return drafts

    def _token(self, known: list[int], position: int) -> int:
        right = known[position] if position < len(known) else 0
        return right if self.rng.random() < self.p else (right + 1) % self.vocab


def acceptance_p(length: float, k: int) -> float:
    """The p whose chain of k drafts yields `length` tokens per verify step: 1 + p + ... + p^k."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(mid**i for i in range(k + 1)) < length else (lo, mid)
    return lo


class Always:
    def speculate(self, batch: int) -> bool:
        return True

    def record(self, *args) -> None:
        pass


def tokens_per_verify(engine: Engine) -> float:
    """Mean tokens a verify step gave each request that drafted: accepted drafts plus the one after."""
    stats = engine.stats()
    return (stats.accepted_draft_tokens + stats.drafts) / stats.drafts if stats.drafts else float("nan")


# -- the parts ------------------------------------------------------------------------------------


def verify_cost(target: Target, args: argparse.Namespace) -> None:
    print("\nverify step: model step time of a batch of decodes verifying n drafted tokens each, / plain decode")
    drafts = sorted({0, *(args.verify_drafts or range(args.k + 1))})
    for batch in args.verify_batches:
        engine = target.engine(batch, args.prompt + 8, max(args.k, drafts[-1]))
        fill(engine, prompts(batch, args.prompt, seed=batch))
        rounds = [[step_seconds(engine, n) for n in drafts] for _ in range(args.repeats)]
        times = [float(np.median(column)) for column in zip(*rounds)]  # alternating: load hits every n alike
        row = "  ".join(f"n={n}: {t * 1e3:.2f} ms ({t / times[0]:.2f}x)" for n, t in zip(drafts, times))
        per_token = (times[-1] / times[0] - 1) / drafts[-1]
        print(f"batch {batch}: {row}; each extra token per request: +{per_token:.1%} of a decode step")
        if engine.device.type == "cpu":
            few_rows_beside_blas(engine, [0, args.k], args.repeats)


def few_rows_beside_blas(engine: Engine, drafted: list[int], rounds: int) -> None:
    """The CPU's projections of a step of up to qwen3.FEW_ROWS rows run on the numba kernel; the
    same steps with them on BLAS (F.linear), in alternating rounds: the median of each."""
    kernel_rows = qwen3.FEW_ROWS
    times: dict[tuple[int, int], list[float]] = {(few, n): [] for few in (kernel_rows, 0) for n in drafted}
    try:
        for _ in range(rounds):
            for few in (kernel_rows, 0):
                qwen3.FEW_ROWS = few
                for n in drafted:
                    times[(few, n)].append(step_seconds(engine, n))
    finally:
        qwen3.FEW_ROWS = kernel_rows
    for n in drafted:
        kernel, blas = (float(np.median(times[(few, n)])) for few in (kernel_rows, 0))
        print(
            f"  n={n}: projections on the kernel {kernel * 1e3:.2f} ms, on BLAS {blas * 1e3:.2f} ms: {kernel / blas:.2f}x"
        )


def fill(engine: Engine, work: list[list[int]]) -> None:
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    for i, prompt in enumerate(work):
        engine.add_request(f"fill-{i}", prompt, params)
    started: set[str] = set()
    while len(started) < len(work):
        started.update(o.request_id for o in engine.step() if o.new_token_ids)


def step_seconds(engine: Engine, n: int, runs: int = 5) -> float:
    """The model step of the engine's running requests, each decoding its next token after n
    drafted ones: the median of `runs` (of `clock`) after one warm-up; on CUDA, do_bench's."""
    chunks = []
    for req in engine.scheduler.running:
        engine.scheduler.pages.reserve_draft(req, n)
        chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1 + n, True, [7] * n))
    if engine.device.type == "cuda":
        return median_seconds(lambda: engine.runner.run(chunks), engine.device)
    engine.runner.run(chunks)
    times = []
    for _ in range(runs):
        start = clock(engine.device)
        engine.runner.run(chunks)
        times.append(clock(engine.device) - start)
    return float(np.median(times))


def controlled(target: Target, args: argparse.Namespace) -> None:
    work = prompts(args.batch, args.prompt)
    context = args.prompt + args.output
    plain = target.engine(args.batch, context, args.k)
    plain_out = plain.generate(work, SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True))
    known = {tuple(p): o.token_ids for p, o in zip(work, plain_out)}
    p = acceptance_p(args.acceptance_length, args.k)
    print(f"\ncontrolled acceptance, batch {args.batch}, {args.output} output tokens, k = {args.k}:")
    print("(each configuration's runs alternate with the engine's without speculation: medians over the pairs)")
    for label, prob, adaptive in (
        ("p = 1 (every draft right, at no cost: the verify step's ceiling)", 1.0, False),
        (f"p = {p:.3f} (expected acceptance length {args.acceptance_length:g}), every step speculating", p, False),
        (f"p = {p:.3f}, the adaptive rule deciding", p, True),
        ("p = 0 (no draft ever right), the adaptive rule deciding", 0.0, True),
        ("p = 0, every step speculating", 0.0, False),
    ):
        engine = speculating_engine(target, args, context, Oracle(known, prob, target.config.vocab_size), adaptive)
        report(label, engine, plain, work, args, plain_out)
    ceiling = target.engine(args.batch, context, args.k, speculative_method="draft", speculative_model=str(target.path))
    ceiling.speculator.adaptive = Always()
    label = "the model drafting for itself (every draft right, at a draft model's cost: as large as the target)"
    report(label, ceiling, plain, work, args, plain_out)


def speculating_engine(target: Target, args, context: int, proposer, adaptive: bool, **settings) -> Engine:
    settings = {"speculative_method": "ngram", **settings}
    engine = target.engine(args.batch, context, args.k, num_speculative_tokens=args.k, **settings)
    engine.speculator.proposer = proposer
    if not adaptive:
        engine.speculator.adaptive = Always()
    return engine


def report(label: str, engine: Engine, plain: Engine, work, args, plain_out) -> float:
    """Runs `engine` and `plain` alternately, `args.repeats` times each after one run of each, and
    prints the median of each pair's ratio (a drift of the machine's speed hits both of a pair alike)
    and the median rates; the outputs must be the plain engine's."""
    rates, plain_rates = [], []
    for _ in range(args.repeats):
        rate, out = generate_rate(engine, work, args.output, 1)
        rates.append(rate)
        plain_rates.append(generate_rate(plain, work, args.output, 1)[0])
        if [o.token_ids for o in out] != [o.token_ids for o in plain_out]:
            raise RuntimeError(f"{label}: the output differs from the engine's without speculation")
    ratios = [r / p for r, p in zip(rates, plain_rates)]
    stats = engine.stats()
    print(
        f"{label}: {np.median(rates):,.1f} tok/s, without {np.median(plain_rates):,.1f}: "
        f"{np.median(ratios):.2f}x (pairs {', '.join(f'{r:.2f}' for r in ratios)}); "
        f"{tokens_per_verify(engine):.2f} tokens per verify, "
        f"{stats.drafts / (args.batch * stats.steps):.0%} of request-steps drafted"
    )
    return float(np.median(ratios))


def ngram(target: Target, args: argparse.Namespace) -> None:
    work = prompts(args.batch, args.prompt, seed=1)
    context = args.prompt + args.output
    plain = target.engine(args.batch, context, args.k)
    plain_out = plain.generate(work, SamplingParams(temperature=0, max_tokens=args.output, ignore_eos=True))
    repeats = np.mean([1 - len(set(o.token_ids)) / len(o.token_ids) for o in plain_out])
    print(f"\nn-gram lookup, batch {args.batch}: the output repeats itself ({repeats:.0%} of its tokens seen before)")
    engine = target.engine(args.batch, context, args.k, speculative_method="ngram", num_speculative_tokens=args.k)
    report("ngram, the adaptive rule deciding", engine, plain, work, args, plain_out)


def stage(target: Target, args: argparse.Namespace) -> None:
    p = acceptance_p(args.acceptance_length, args.k)
    print(f"\nstage: acceptance set by construction (p = {p:.3f}: acceptance length {args.acceptance_length:g})")
    with tempfile.TemporaryDirectory() as tmp:
        head = write_random_eagle3_head(Path(tmp) / "eagle3", read_config(target.path), draft_vocab_size=32000)
        for batch in args.stage_batches:
            # One plain run per batch for both proposers: the stage's GPU time is what bounds it.
            work = prompts(batch, args.prompt, seed=batch)
            plain_engine = target.engine(batch, args.prompt + args.output, args.k)
            plain = generate_rate(plain_engine, work, args.output, args.repeats)
            del plain_engine  # its KV pool and graphs, before the next engine takes its own
            for method, model in (("draft", args.stage_draft), ("eagle3", str(head))):
                stage_row(target, args, method, model, work, plain, p)


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def stage_row(target: Target, args, method: str, model: str, work: list[list[int]], plain, p: float) -> None:
    plain_rate, plain_out = plain
    batch = len(work)
    known = {tuple(q): o.token_ids for q, o in zip(work, plain_out)}
    engine = target.engine(
        batch,
        args.prompt + args.output,
        args.k,
        speculative_method=method,
        speculative_model=model,
        num_speculative_tokens=args.k,
    )
    engine.speculator.proposer = Oracle(known, p, target.config.vocab_size, inner=engine.speculator.proposer)
    rate, out = generate_rate(engine, work, args.output, args.repeats)
    if [o.token_ids for o in out] != [o.token_ids for o in plain_out]:
        raise RuntimeError(f"stage {method} batch {batch}: the output differs from the engine's without speculation")
    print(
        f"stage {method} batch {batch}: {rate:,.1f} tok/s with, {plain_rate:,.1f} without: {rate / plain_rate:.2f}x "
        f"({tokens_per_verify(engine):.2f} tokens per verify)"
    )


if __name__ == "__main__":
    main()
