"""The engine's host work per decode step: `Engine.step()` with the model and the LM head stubbed.

The stub model returns logits of the right shape ([rows, vocab], from a fixed bank of random
logits) in no time, so what a step costs is the engine's own work on the host: scheduling,
building the step's metadata, sampling, and reading the tokens back (stop checks,
detokenization, the outputs). That is the work overlapped scheduling must hide behind the
device's step on a GPU.

Each configuration (batch, greedy or sampled) fills an engine with `batch` requests whose
contexts are uniform in [600, 1600] tokens, prefills them, and times `--steps` decode steps
(median). The same figures for the code at `--baseline` (a commit, checked out into a
temporary worktree) come from a second process, run interleaved with this one: one
configuration at a time, alternating, so both see the same machine.

    python -m bench.host_overhead                         # batch 16, 64, 256; greedy and sampled; 1 thread
    python -m bench.host_overhead --batches 256 --steps 20 --rounds 1

The stub's vocabulary is `--vocab` tokens (the first ids of Qwen3's, real subwords): the
sampler's work over a row of the full 151,936-token vocabulary is device work on a GPU, and on
this CPU it would swamp the host's. A second table measures that work on its own: one
`Sampler.sample` call on [256, 151,936] logits, top-p and top-k cuts, old code against new.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PHASES = ("schedule", "prepare", "sample", "read")
MODES = {
    "greedy": {"temperature": 0.0},
    "sampled": {"temperature": 0.8, "top_p": 0.9},
    "penalized": {"temperature": 0.0, "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.2},
}
CONTEXT = (600, 1600)
SAMPLER_CASES = {  # name: (logits scale, sampling parameters)
    "peaked, top_p 0.9": (4.0, {"temperature": 0.8, "top_p": 0.9}),
    "peaked, top_k 40 + top_p 0.95": (4.0, {"temperature": 0.8, "top_k": 40, "top_p": 0.95}),
    "flat, top_p 0.9": (1.0, {"temperature": 0.8, "top_p": 0.9}),  # nuclei of thousands: the full sort
}
LOGIT_BANK = 8  # row offsets the stub's logits cycle through, so tokens vary from step to step


# -- measuring process: imports the engine of one code tree ---------------------------------------


class StubModel:
    """Stands in for Qwen3ForCausalLM: hidden states are the input ids, logits come from a bank.

    Step n's logits are rows [n % LOGIT_BANK, n % LOGIT_BANK + batch) of one random matrix, so
    each request's token changes from step to step. On a GPU the logits never touch the host;
    copying them into the runner's buffer here would write 4 MB through the host's caches every
    step (256 rows of 4,096) and slow down everything after it, so the stub returns views, and
    copies only for requests whose sampling writes to its logits (penalties)."""

    def __init__(self, vocab: int, max_rows: int, dtype, copies: bool):
        from types import SimpleNamespace

        import torch

        self.model = SimpleNamespace(norm=SimpleNamespace(weight=torch.zeros(1, dtype=dtype)))  # the KV dtype
        self.bank = torch.randn(max_rows + LOGIT_BANK, vocab, generator=torch.Generator().manual_seed(0)) * 4
        self.copies = copies
        self.calls = 0

    def __call__(self, input_ids, positions, meta, kv_caches, lora=None):
        return input_ids[:, None]

    def compute_logits(self, hidden, out=None):
        self.calls += 1
        first = self.calls % LOGIT_BANK
        logits = self.bank[first : first + hidden.shape[0]]
        return logits.clone() if self.copies else logits


class PhaseTimer:
    """Accumulates the wall time of wrapped methods, per phase, over one step."""

    def __init__(self):
        self.totals = dict.fromkeys((*PHASES, "stub"), 0.0)

    def wrap(self, owner, name: str, phase: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - start

        setattr(owner, name, timed)

    def reset(self) -> None:
        for k in self.totals:
            self.totals[k] = 0.0


def build_engine(batch: int, vocab: int, mode: str):
    import torch

    from worker.engine import Engine, EngineSettings
    from worker.model.config import Qwen3Config
    from worker.model.presets import resolve_model_path
    from worker.model.tokenizer import Tokenizer

    config = Qwen3Config(
        model_type="qwen3",
        vocab_size=vocab,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=4096,
    )
    pages = batch * (CONTEXT[1] + 512) // 16
    settings = EngineSettings.parse(
        page_size=16,
        num_pages=pages,
        max_running=batch,
        max_num_batched_tokens=max(4096, batch),
    )
    tokenizer = Tokenizer.from_dir(resolve_model_path("tiny"))
    stub = StubModel(vocab, batch, torch.float32, copies=mode == "penalized")
    return Engine(stub, config, tokenizer, settings, [], torch.device("cpu"))


def fill(engine, batch: int, mode: str, seed: int) -> None:
    """Admits `batch` requests and steps until every one has its first token, so all decode."""
    from producer_client.schema import SamplingParams

    rng = random.Random(seed)
    for i in range(batch):
        params = SamplingParams(max_tokens=2000, ignore_eos=True, seed=None, **MODES[mode])
        prompt = [rng.randrange(engine.vocab_size) for _ in range(rng.randint(*CONTEXT))]
        engine.add_request(f"r{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)


def measure(batch: int, mode: str, steps: int, vocab: int) -> dict:
    """Median ms per step and per phase over `steps` decode steps of a filled engine."""
    engine = build_engine(batch, vocab, mode)
    fill(engine, batch, mode, seed=batch)
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "prepare", "prepare")
    timer.wrap(engine.sampler, "sample", "sample")
    timer.wrap(engine.sampler, "read", "sample")
    timer.wrap(engine.runner.model, "compute_logits", "stub")  # its forward only returns a view
    samples = {k: [] for k in ("step", *PHASES)}
    for _ in range(steps + 3):
        timer.reset()
        start = time.perf_counter()
        outputs = engine.step()
        total = time.perf_counter() - start
        if len(outputs) != batch:
            raise RuntimeError(f"a decode step reported {len(outputs)} outputs for {batch} requests")
        t = timer.totals
        t["read"] = total - t["stub"] - t["schedule"] - t["prepare"] - t["sample"]
        samples["step"].append(total - t["stub"])
        for phase in PHASES:
            samples[phase].append(t[phase])
    return {k: statistics.median(v[3:]) * 1e3 for k, v in samples.items()}


def measure_sampler(rows: int, vocab: int, case: str, calls: int) -> dict:
    """Median ms of `calls` Sampler.sample calls on fixed [rows, vocab] logits (not written to)."""
    import torch

    from producer_client.schema import SamplingParams
    from worker.engine.request import Request
    from worker.engine.sampler import Sampler

    scale, params = SAMPLER_CASES[case]
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1)) * scale
    requests = [Request(f"r{i}", [0], SamplingParams(**params), 0, i, None, None) for i in range(rows)]
    sampler = Sampler([])
    sampler.sample(logits, requests)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        sampler.sample(logits, requests)
        times.append(time.perf_counter() - start)
    return {"sample": statistics.median(times) * 1e3}


def serve_measurements(code: Path, threads: int) -> None:
    """The measuring process: one JSON request per stdin line, one JSON result per stdout line."""
    sys.path.insert(0, str(code))
    import torch

    torch.set_num_threads(threads)
    for line in sys.stdin:
        job = json.loads(line)
        if job.pop("kind") == "sampler":
            result = measure_sampler(**job)
        else:
            result = measure(**job)
        print(json.dumps(result), flush=True)


# -- driver ----------------------------------------------------------------------------------------


class Measurer:
    def __init__(self, code: Path, threads: int):
        self.code = code
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.host_overhead", "--serve", str(code), "--threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=REPO,
        )

    def __call__(self, **job) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the measuring process for {self.code} died")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def baseline_tree(commit: str) -> Path:
    """A detached worktree of `commit` under /tmp (made once, reused)."""
    sha = subprocess.check_output(["git", "-C", str(REPO), "rev-parse", commit], text=True).strip()
    path = Path("/tmp") / f"mili-baseline-{sha[:10]}"
    if not path.exists():
        subprocess.check_call(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(path), sha], stdout=subprocess.DEVNULL
        )
    return path


def main() -> None:
    args = parse_args()
    if args.serve:
        serve_measurements(Path(args.serve), args.threads)
        return
    old, new = Measurer(baseline_tree(args.baseline), args.threads), Measurer(REPO, args.threads)
    try:
        print_step_table(args, old, new)
        print_sampler_table(args, old, new)
    finally:
        old.close()
        new.close()


def interleaved(old: Measurer, new: Measurer, rounds: int, **job) -> dict:
    """Each side measured `rounds` times, alternating, so both see the same machine."""
    results = {"old": [], "new": []}
    for _ in range(rounds):
        results["old"].append(old(**job))
        results["new"].append(new(**job))
    return results


def print_step_table(args: argparse.Namespace, old: Measurer, new: Measurer) -> None:
    print(
        f"ms per decode step (median of {args.steps}), {args.threads} torch thread(s), stub vocab {args.vocab}, "
        f"contexts {CONTEXT[0]}-{CONTEXT[1]}; new / old ({args.baseline}) = ratio, median of {args.rounds} rounds"
    )
    print(f"{'batch':>5} {'mode':>8} | " + " | ".join(f"{k:>24}" for k in ("step", *PHASES)))
    for batch in args.batches:
        for mode in MODES:
            job = {"kind": "step", "batch": batch, "mode": mode, "steps": args.steps, "vocab": args.vocab}
            rounds = interleaved(old, new, args.rounds, **job)
            print(
                f"{batch:>5} {mode:>8} | " + " | ".join(compare(rounds, key) for key in ("step", *PHASES)), flush=True
            )


def print_sampler_table(args: argparse.Namespace, old: Measurer, new: Measurer) -> None:
    rows, vocab = args.sampler_shape
    print(
        f"\nms per Sampler.sample on [{rows}, {vocab:,}] logits (median of {args.sampler_calls} calls); "
        f"new / old = ratio, median of {args.rounds} rounds"
    )
    for case in SAMPLER_CASES:
        job = {"kind": "sampler", "rows": rows, "vocab": vocab, "case": case, "calls": args.sampler_calls}
        print(f"{case:>30} | {compare(interleaved(old, new, args.rounds, **job), 'sample')}", flush=True)


def compare(rounds: dict, key: str) -> str:
    """'new / old = ratio' for one column, each the median over rounds."""
    old = statistics.median(r[key] for r in rounds["old"])
    new = statistics.median(r[key] for r in rounds["new"])
    return f"{new:7.2f} /{old:7.2f} ={new / old:5.2f}x"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--steps", type=int, default=50, help="timed decode steps per configuration")
    p.add_argument("--rounds", type=int, default=3, help="alternating old/new measurements per configuration")
    p.add_argument("--vocab", type=int, default=4096, help="the stub's vocabulary (logits columns)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in both measuring processes")
    p.add_argument("--sampler-shape", type=int, nargs=2, default=[256, 151_936], metavar=("ROWS", "VOCAB"))
    p.add_argument("--sampler-calls", type=int, default=3, help="timed Sampler.sample calls per round")
    p.add_argument("--baseline", default="67d77dc", help="the commit measured beside this tree")
    p.add_argument("--serve", help=argparse.SUPPRESS)  # internal: be a measuring process for this code tree
    return p.parse_args()


if __name__ == "__main__":
    main()
