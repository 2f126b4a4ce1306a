"""Decode step time at a full batch, beside its memory-bandwidth bound.

A decode step reads every weight once and every running request's whole KV context, so memory
bandwidth sets a floor under it:

    bound = (weight bytes + KV bytes of all contexts) / bandwidth

the bandwidth being what a large device-to-device copy reaches in the same run (bench/timing.py;
the H100 datasheet's 3.35 TB/s is printed beside it).

The script fills an engine with `--batch` requests of `--context` random prompt tokens, runs
their prefill, then times decode steps two ways: the model step alone (`ModelRunner.run`,
which replays the decode CUDA graph on CUDA) and whole engine steps (scheduling, sampling,
stop checks, outputs). Both print beside the bound; the issue's target is within 2x of it.

With `--trace PATH`, `--profile-steps` more engine steps then run under torch.profiler, each a
range named `engine_step`; the gzipped Chrome trace goes to PATH (https://ui.perfetto.dev opens
it), and the share of their span the GPU was busy and the idle gaps between its work are
printed (bench/trace_timeline.py).

    python -m bench.decode_step --trace decode_trace.json.gz     # qwen3-0.6b, bf16, batch 256, context 1024
    python -m bench.decode_step --model tiny --batch 8 --context 64 --steps 3    # CPU smoke
"""

import argparse
import gzip
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.offline import PROMPT_ID_LIMIT, add_engine_switches, add_kv_cache_mib, engine_settings
from bench.timing import H100_DATASHEET_BYTES_PER_S, copy_bandwidth
from bench.trace_timeline import STEP_RANGE, Timeline
from producer_client.schema import SamplingParams
from worker.engine import Engine, EngineSettings
from worker.engine.engine import overlap_enabled


def main() -> None:
    args = parse_args()
    settings = {"max_running": args.batch, "max_num_batched_tokens": max(args.batch, 8192), **engine_settings(args)}
    # Filling and the model step need every sampled token on the host; engine steps then run
    # overlapped or not as asked (the engine reads the switch at each step).
    overlap = overlap_enabled(EngineSettings.parse(**settings), torch.device(args.device))
    settings["overlap_schedule"] = False
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, **settings)
    fill(engine, args.batch, args.context, args.warmup + 2 * args.steps + args.profile_steps + 2)
    chunks = engine.scheduler.schedule().chunks  # the next decode step; computed repeatedly below, never committed
    if len(chunks) != args.batch or any(c.num_tokens != 1 for c in chunks):
        raise RuntimeError(f"expected a decode step of {args.batch} requests, got {len(chunks)} chunks")
    model_ms = timed(lambda: engine.runner.run(chunks), args.warmup, args.steps, engine.device)
    engine.stepper.overlap = overlap  # the step pipeline reads it at each step
    step_ms = timed(engine.step, 1, args.steps, engine.device)

    nbytes = bytes_read(engine, chunks)
    bandwidth = copy_bandwidth(engine.device)
    bound_ms = nbytes / bandwidth * 1e3
    print(
        f"{args.model} on {args.device}: batch {args.batch}, context {args.context}, "
        f"decode CUDA graphs {'on' if engine.runner.decode_graphs else 'off'}, "
        f"overlapped scheduling {'on' if engine.overlap else 'off'}"
    )
    print(
        f"bound: {nbytes / 1e9:.3f} GB of weights and KV at the measured copy bandwidth, "
        f"{bandwidth / 1e9:,.0f} GB/s: {bound_ms:.3f} ms "
        f"(at the H100 datasheet's {H100_DATASHEET_BYTES_PER_S / 1e9:,.0f} GB/s: "
        f"{nbytes / H100_DATASHEET_BYTES_PER_S * 1e3:.3f} ms)"
    )
    print(f"model step:  {model_ms:.3f} ms = {model_ms / bound_ms:.2f}x the bound")
    print(
        f"engine step: {step_ms:.3f} ms = {step_ms / bound_ms:.2f}x the bound "
        f"({args.batch / step_ms * 1e3:,.0f} output tok/s at this batch)"
    )
    if args.trace:
        print_profile(profiled_steps(engine, args.profile_steps, args.trace), args.trace, engine.device)


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b" if cuda else "tiny", help="preset name or checkpoint directory")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default=None, help="default: the checkpoint's")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="timed steps of each kind")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--trace", type=Path, help="profile engine steps after the timings; the gzipped Chrome trace goes here"
    )
    p.add_argument("--profile-steps", type=int, default=20, help="engine steps profiled with --trace")
    add_kv_cache_mib(p)
    add_engine_switches(p)
    p.set_defaults(max_num_batched_tokens=None, max_running=None)  # set from --batch
    return p.parse_args()


def fill(engine: Engine, batch: int, context: int, max_tokens: int) -> None:
    """Admits the requests and steps until every one has its first token, so all decode."""
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{i}", [rng.randrange(PROMPT_ID_LIMIT) for _ in range(context)], params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.request_id for o in engine.step() if o.new_token_ids)


def timed(fn, warmup: int, steps: int, device: torch.device) -> float:
    """Mean milliseconds per call over `steps` back-to-back calls, the device drained at both ends."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profiled_steps(engine: Engine, steps: int, trace: Path) -> Timeline:
    """Runs `steps` engine steps under torch.profiler (CUDA activity too where there is a GPU),
    writes the gzipped Chrome trace to `trace` and reads the timeline back from it."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function(STEP_RANGE):
                engine.step()
        sync(engine.device)
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(plain))
        events = json.loads(plain.read_text())["traceEvents"]
        trace.parent.mkdir(parents=True, exist_ok=True)
        with plain.open("rb") as src, gzip.open(trace, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return Timeline.from_trace(events)


def print_profile(timeline: Timeline, trace: Path, device: torch.device) -> None:
    step_ms = [(b - a) / 1e3 for a, b in timeline.steps]
    print(
        f"profiled {len(step_ms)} engine steps (trace: {trace}): median {statistics.median(step_ms):.3f} ms "
        f"on the host, span {timeline.span_us / 1e3:.3f} ms"
    )
    if device.type != "cuda":
        print("GPU busy: not measured (no CUDA: a CPU trace holds no device work)")
        return
    print(f"GPU busy: {timeline.busy_share():.1%} of the profiled steps' span")
    gaps = timeline.gaps_us()
    if gaps:
        print(
            f"GPU idle gaps: {len(gaps)}, median {statistics.median(gaps):.1f} us, max {max(gaps):.1f} us, "
            f"total {sum(gaps) / 1e3:.3f} ms"
        )


def bytes_read(engine: Engine, chunks) -> int:
    """Bytes a decode step must read once: the weights and every context's K and V. An untied
    embedding table is not read whole (a step looks up one row per request)."""
    model = engine.runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        weights -= embed.numel() * embed.element_size()
    k_cache = engine.runner.kv_caches[0][0]
    kv_per_token = 2 * len(engine.runner.kv_caches) * k_cache[0, 0].numel() * k_cache.element_size()
    kv = sum(c.start + c.num_tokens for c in chunks) * kv_per_token
    return weights + kv


if __name__ == "__main__":
    main()
