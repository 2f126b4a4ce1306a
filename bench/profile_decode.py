"""A torch.profiler trace of steady decode steps: how much of their time the GPU is busy, and the
gaps between its work (host time the device waits through: scheduling, sampling, reading back).

The engine is filled with `--batch` requests of `--context` random prompt tokens and stepped until
every one decodes; `--warmup` more steps pass, then `--steps` engine steps (overlapped and with
decode CUDA graphs as the device's defaults, or as the switches say) run under the profiler, each
marked as a range named `engine_step`. The trace goes to `--trace` (gzipped Chrome trace JSON: open
it in https://ui.perfetto.dev). Read from the trace: the GPU-busy share of the steps' span (the
union of kernel, copy and memset intervals), and the idle gaps between that work.

    python bench/profile_decode.py --trace decode_trace.json.gz            # qwen3-0.6b, batch 256, context 1024
    python bench/profile_decode.py --model tiny --batch 8 --context 64 --trace /tmp/t.json.gz   # CPU: step times only
"""
import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

# Run as a script, this file's directory leads sys.path and would shadow the `kernels` package.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from bench.decode_step import fill, sync  # noqa: E402
from bench.trace_timeline import STEP_RANGE, Timeline  # noqa: E402
from bench.offline import add_engine_switches, engine_settings  # noqa: E402
from worker.engine import Engine  # noqa: E402

def main() -> None:
    args = parse_args()
    settings = {"max_running": args.batch, "max_num_batched_tokens": max(args.batch, 8192), **engine_settings(args)}
    engine = Engine.from_pretrained(args.model, device=args.device, dtype=args.dtype, **settings)
    fill(engine, args.batch, args.context, args.warmup + args.steps + 4)
    for _ in range(args.warmup):
        engine.step()
    sync(engine.device)
    cuda = engine.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            with record_function(STEP_RANGE):
                engine.step()
        sync(engine.device)
    events = write_trace(prof, args.trace)
    report(Timeline.from_trace(events), engine, args, cuda)


def parse_args() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-0.6b" if cuda else "tiny", help="preset name or checkpoint directory")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default=None, help="default: the checkpoint's")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=20, help="profiled engine steps")
    p.add_argument("--warmup", type=int, default=5, help="steps after filling, before the profile")
    p.add_argument("--trace", type=Path, required=True, help="where the gzipped Chrome trace goes")
    add_engine_switches(p)
    p.set_defaults(max_num_batched_tokens=None, max_running=None)  # set from --batch
    return p.parse_args()


def write_trace(prof, path: Path) -> list[dict]:
    """Gzips the profiler's Chrome trace to `path`; returns its events."""
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(plain))
        events = json.loads(plain.read_text())["traceEvents"]
        path.parent.mkdir(parents=True, exist_ok=True)
        with plain.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return events


def report(timeline: Timeline, engine: Engine, args: argparse.Namespace, cuda: bool) -> None:
    step_ms = [(b - a) / 1e3 for a, b in timeline.steps]
    print(f"{args.model} on {args.device}: batch {args.batch}, context {args.context}, {len(step_ms)} steps profiled, "
          f"decode CUDA graphs {'on' if engine.runner.decode_graphs else 'off'}, "
          f"overlapped scheduling {'on' if engine.overlap else 'off'}; trace: {args.trace}")
    print(f"engine step (host range): median {statistics.median(step_ms):.3f} ms, max {max(step_ms):.3f} ms, "
          f"span {timeline.span_us / 1e3:.3f} ms")
    if not cuda:
        print("GPU busy: none measured (no CUDA: a CPU trace holds no device work)")
        return
    gaps = timeline.gaps_us()
    print(f"GPU busy: {timeline.busy_share():.1%} of the steps' span")
    if gaps:
        print(f"GPU idle gaps: {len(gaps)}, median {statistics.median(gaps):.1f} us, max {max(gaps):.1f} us, "
              f"total {sum(gaps) / 1e3:.3f} ms")


if __name__ == "__main__":
    main()
