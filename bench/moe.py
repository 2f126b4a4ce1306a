"""Qwen3-MoE: the fused MoE kernel at Qwen3-30B-A3B's shapes, and whole decode steps against
their memory-bandwidth bound, beside the baselines they replace, in one run.

    python -m bench.moe                    # CUDA: Qwen3-30B-A3B shapes, bf16
    python -m bench.moe --tiny             # the CPU rehearsal (the default without CUDA): tiny-moe, fp32

Kernel rows: the experts of one layer (128 experts of hidden 2048 and intermediate 768, 8 per
token) for a decode batch of 64 and of 256 tokens, and a 4096-token prefill step. Each is
checked against transformers' per-expert loop before it is timed, and timed beside it and (on
CUDA) beside torch's grouped GEMM (F.grouped_mm, CUTLASS on Hopper). Decode batches report the
bandwidth achieved on the bytes that must move (the weights of the experts the batch hit, its
input and output) against HBM; the prefill, its TFLOP/s against the bf16 dense peak. On CPU
the rows are tiny-moe's experts, and wall and CPU time of our CPU path (kernels/fused_moe.py's
reference) against the per-expert loop.

Decode rows: a model of the whole Qwen3-30B-A3B shape with random weights built on the device
(`--layers` cuts it down), an engine holding `batch` requests of `--context` tokens, and the
decode step's time (the CUDA graph's replay) against its bound: the bytes it must read (the
dense weights, the weights of the experts each layer's batch hit, every context's K and V) over
HBM bandwidth. Random routers spread tokens over the experts more evenly than trained ones;
the bound counts the experts actually hit. On CPU the model is tiny-moe and the bandwidth the
one a large copy achieves on this machine, measured in the same run.
"""

import argparse
import functools
import logging
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.decode_step import fill, timed
from kernels.fused_moe import fused_moe, fused_moe_per_expert_loop, fused_moe_reference
from worker.engine import Engine, EngineSettings
from worker.model.config import parse_config
from worker.model.moe import Router
from worker.model.presets import PRESETS, qwen3_moe_config, random_model
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files
from worker.model.tokenizer import Tokenizer

log = logging.getLogger("bench.moe")

# Qwen3-30B-A3B's config.json (Hugging Face, Qwen/Qwen3-30B-A3B).
QWEN3_30B_A3B = qwen3_moe_config(
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    tie_word_embeddings=False,
)
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
BF16_DENSE_FLOPS = {"H100": 989e12, "H200": 989e12}


@dataclass
class Shape:
    experts: int
    top_k: int
    hidden: int
    inter: int

    @classmethod
    def of(cls, config: dict) -> "Shape":
        return cls(
            config["num_experts"], config["num_experts_per_tok"], config["hidden_size"], config["moe_intermediate_size"]
        )

    def __str__(self) -> str:
        return f"E={self.experts} k={self.top_k} H={self.hidden} I={self.inter}"


@dataclass
class Timing:
    wall_ms: float
    cpu_ms: float | None = None  # CPU time of this process per call (CPU runs only)


def time_cpu(fn: Callable[[], object], repeats: int) -> Timing:
    """The least wall and the least CPU time of `repeats` calls: the least disturbed by the other
    processes this machine runs."""
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        cpu, wall = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return Timing(min(walls) * 1e3, min(cpus) * 1e3)


def time_cuda(fn: Callable[[], object]) -> Timing:
    import triton.testing

    return Timing(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def device_peak(table: dict[str, float], device: torch.device) -> float | None:
    name = torch.cuda.get_device_name(device)
    return next((value for card, value in table.items() if card in name), None)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second a 512 MiB copy moves here (read + write), best of five."""
    src = torch.ones(2**27, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    timing = time_cuda(lambda: dst.copy_(src)) if device.type == "cuda" else time_cpu(lambda: dst.copy_(src), 5)
    return 2 * src.nbytes / (timing.wall_ms * 1e-3)


def moe_inputs(shape: Shape, tokens: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """Hidden states, routing (a random router's top-k: k distinct experts per token) and expert weights."""
    g = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(tokens, shape.hidden, generator=g, device=device).to(dtype)
    weights, ids = torch.softmax(torch.randn(tokens, shape.experts, generator=g, device=device), -1).topk(shape.top_k)
    w13 = (torch.randn(shape.experts, 2 * shape.inter, shape.hidden, generator=g, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(shape.experts, shape.hidden, shape.inter, generator=g, device=device) * 0.02).to(dtype)
    return hidden, w13, w2, weights.to(dtype), ids


def check_against_loop(label: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    if error > tolerance:
        raise SystemExit(f"{label}: relative error {error:.2e} against the per-expert loop exceeds {tolerance}")
    log.info("%s: relative error %.2e against the per-expert loop", label, error)


def kernel_rows(shape: Shape, token_counts: list[int], dtype: torch.dtype, device: torch.device) -> list[str]:
    rows = []
    for tokens in token_counts:
        args = moe_inputs(shape, tokens, dtype, device)
        label = f"{shape} T={tokens}"
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        check_against_loop(label, fused_moe(*args), fused_moe_per_expert_loop(*args), tolerance)
        if device.type == "cuda":
            rows.append(cuda_kernel_row(label, shape, tokens, args, device))
        else:
            ours = time_cpu(functools.partial(fused_moe, *args), 10)
            loop = time_cpu(functools.partial(fused_moe_per_expert_loop, *args), 10)
            rows.append(
                f"| {label} | {ours.wall_ms:.3f} | {ours.cpu_ms:.3f} | {loop.wall_ms:.3f} | {loop.cpu_ms:.3f} "
                f"| {loop.cpu_ms / ours.cpu_ms:.2f}x |"
            )
        del args
    return rows


def cuda_kernel_row(label: str, shape: Shape, tokens: int, args, device: torch.device) -> str:
    hidden, w13, w2, _, ids = args
    ours = time_cuda(lambda: fused_moe(*args)).wall_ms
    grouped = time_cuda(lambda: fused_moe_reference(*args)).wall_ms
    loop = time_cuda(lambda: fused_moe_per_expert_loop(*args)).wall_ms
    hit = ids.unique().numel()
    element = hidden.element_size()
    moved = hit * 3 * shape.hidden * shape.inter * element + 2 * hidden.numel() * element
    flops = 2 * ids.numel() * 3 * shape.hidden * shape.inter
    hbm, peak = device_peak(HBM_BYTES_PER_S, device), device_peak(BF16_DENSE_FLOPS, device)
    bandwidth, flop_rate = moved / (ours * 1e-3), flops / (ours * 1e-3)
    rate = f"{bandwidth / 1e9:.0f} GB/s" + (f" = {bandwidth / hbm:.0%} of HBM" if hbm else "")
    rate += f"; {flop_rate / 1e12:.0f} TFLOP/s" + (f" = {flop_rate / peak:.0%} of peak" if peak else "")
    return (
        f"| {label} ({hit} experts hit) | {ours:.3f} | {grouped:.3f} ({grouped / ours:.2f}x) "
        f"| {loop:.3f} ({loop / ours:.2f}x) | {rate} |"
    )


def router_hits(model, run: Callable[[], object]) -> list[int]:
    """Distinct experts each sparse layer's router picks during `run` (an eager forward)."""
    hits, hooks = [], []
    for module in model.modules():
        if isinstance(module, Router):
            hooks.append(module.register_forward_hook(lambda m, i, out: hits.append(out[1].unique().numel())))
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    return hits


def decode_bound_bytes(engine: Engine, chunks) -> int:
    """Dense weights (an untied embedding table is not read whole), each layer's hit experts, every context's K and V."""
    model = engine.runner.model
    size = lambda p: p.numel() * p.element_size()  # noqa: E731
    expert_bytes = sum(size(p) for name, p in model.named_parameters() if ".experts." in name)
    dense = sum(size(p) for p in model.parameters()) - expert_bytes
    if not model.config.tie_word_embeddings:
        dense -= size(model.model.embed_tokens.weight)
    inputs = engine.runner.prepare(chunks)
    forward = lambda: model(inputs.input_ids, inputs.positions, inputs.meta, engine.runner.kv_caches)  # noqa: E731
    with torch.inference_mode():
        hits = router_hits(model, forward)
    per_expert = expert_bytes // (len(hits) * model.config.num_experts) if hits else 0
    k_cache = engine.runner.kv_caches[0][0]
    kv_per_token = 2 * len(engine.runner.kv_caches) * k_cache[0, 0].numel() * k_cache.element_size()
    kv = sum(c.start + c.num_tokens for c in chunks) * kv_per_token
    return dense + sum(hits) * per_expert + kv


def decode_row(name: str, engine: Engine, batch: int, context: int, steps: int, bandwidth: float) -> str:
    """On CPU the step's CPU time stands beside its wall time: other processes share this machine."""
    fill(engine, batch, context, 2 * steps + 8)
    chunks = engine.scheduler.schedule().chunks
    if len(chunks) != batch or any(c.num_tokens != 1 for c in chunks):
        raise SystemExit(f"expected a decode step of {batch} requests, got {len(chunks)} chunks")
    if engine.device.type == "cuda":
        step = Timing(timed(lambda: engine.runner.run(chunks), 3, steps, engine.device))
    else:
        step = time_cpu(lambda: engine.runner.run(chunks), steps)
    ms = step.cpu_ms if step.cpu_ms is not None else step.wall_ms
    bound_ms = decode_bound_bytes(engine, chunks) / bandwidth * 1e3
    how = "CUDA graph" if engine.runner.decode_graphs is not None else "eager"
    measured = f"{step.wall_ms:.3f}" + (f" (CPU {step.cpu_ms:.3f})" if step.cpu_ms is not None else "")
    return (
        f"| {name} | batch {batch}, context {context} | {measured}, {how} | {bound_ms:.3f} "
        f"| {ms / bound_ms:.2f}x | {batch / ms * 1e3:,.0f} |"
    )


def decode_rows(
    name: str,
    model,
    config: dict,
    tokenizer: Tokenizer,
    batches: list[int],
    context: int,
    steps: int,
    device: torch.device,
    bandwidth: float,
) -> list[str]:
    rows = []
    for batch in batches:
        settings = EngineSettings.parse(
            max_running=batch,
            max_num_batched_tokens=max(batch, 8192),
            max_model_len=context + 2 * steps + 16,
            overlap_schedule=False,
        )
        engine = Engine(model, parse_config(config), tokenizer, settings, [], device)
        rows.append(decode_row(name, engine, batch, context, steps, bandwidth))
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def qwen_tokenizer() -> Tokenizer:
    with tempfile.TemporaryDirectory() as tmp:
        write_qwen3_tokenizer_files(Path(tmp))
        return Tokenizer.from_dir(Path(tmp))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--tiny",
        action="store_true",
        default=not torch.cuda.is_available(),
        help="tiny-moe shapes on the CPU (the default without CUDA)",
    )
    p.add_argument("--layers", type=int, default=None, help="decoder layers of the decode model (default: all)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per request (default 512; tiny: 64)")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps (default 20; tiny: 10)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device("cpu" if args.tiny else "cuda")
    tiny = PRESETS["tiny-moe"].config
    config = tiny if args.tiny else QWEN3_30B_A3B
    if args.layers:
        config = {**config, "num_hidden_layers": args.layers}
    dtype = torch.float32 if args.tiny else torch.bfloat16
    context, steps = args.context or (64 if args.tiny else 512), args.steps or (10 if args.tiny else 20)
    where = "CPU" if args.tiny else torch.cuda.get_device_name(device)
    print(f"\n{where}, {dtype}, torch {torch.__version__}, torch threads: {torch.get_num_threads()}\n")

    if args.tiny:
        print("| experts, tokens | ours ms | ours CPU ms | per-expert loop ms | loop CPU ms | CPU time saved |")
        print("|---|---|---|---|---|---|")
        shapes = [(Shape.of(tiny), [1, 16, 64, 512]), (Shape(32, 4, 512, 256), [1, 64])]
    else:
        print("| experts, tokens | fused ms | torch grouped GEMM ms | per-expert loop ms | achieved |")
        print("|---|---|---|---|---|")
        shapes = [(Shape.of(QWEN3_30B_A3B), [64, 256, 4096])]
    for shape, token_counts in shapes:
        for row in kernel_rows(shape, token_counts, dtype, device):
            print(row, flush=True)

    hbm = device_peak(HBM_BYTES_PER_S, device) if device.type == "cuda" else None
    bandwidth, source = (hbm, "the card's HBM") if hbm else (copy_bandwidth(device), "a copy's, measured")
    print(f"\ndecode steps (random weights), bound at {bandwidth / 1e9:,.0f} GB/s ({source})\n")
    print("| model | batch | model step ms | bound ms | step / bound | tokens/s |")
    print("|---|---|---|---|---|---|")
    # On CPU, tiny (the same attention, a dense MLP) runs beside tiny-moe: what the experts add.
    models = [("tiny-moe", config), ("tiny", PRESETS["tiny"].config)] if args.tiny else [("Qwen3-30B-A3B", config)]
    tokenizer = qwen_tokenizer()
    for name, model_config in models:
        label = f"{name}, {model_config['num_hidden_layers']} layers"
        model = random_model(model_config, dtype, device)
        for row in decode_rows(
            label,
            model,
            model_config,
            tokenizer,
            [8, 32] if args.tiny else [64, 256],
            context,
            steps,
            device,
            bandwidth,
        ):
            print(row, flush=True)
        del model
    return 0


if __name__ == "__main__":
    sys.exit(main())
