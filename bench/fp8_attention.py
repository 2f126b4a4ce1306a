"""The attention kernels over a float8 KV cache beside the same kernels over the model's dtype.

    python -m bench.fp8_attention                  # CUDA: Triton kernels, Qwen3-8B's heads, bf16 vs fp8 pages
    python -m bench.fp8_attention --shapes tiny    # the CPU rehearsal: small shapes, whichever device there is

Decode attention is bound by the bytes of K and V it reads: a float8 cache halves them, so at
the same bandwidth a step takes half the time. Each row prints the cache bytes one call reads,
the time, the achieved bandwidth (also as a share of what a large copy moves on the same
device, measured in the same run: bench/timing.py) and the float8 run's speed-up over the
baseline cache, measured in the same run. Extend attention
(prefill after a long cached prefix) and the KV store are timed the same way.

On CUDA the kernels are the Triton ones, against a bf16 cache; on CPU they are the CPU
engine's (numba decode, torch SDPA prefill), against a float32 cache (the CPU engine runs
float32 models), and the CPU time of each call is printed beside its wall time. Each output
is checked against the torch reference over the same float8 cache before it is timed.
"""

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.timing import copy_bandwidth, median_seconds
from kernels.decode_attention import paged_decode_attention, paged_decode_attention_reference
from kernels.extend_attention import paged_extend_attention, paged_extend_attention_reference
from kernels.fp8 import FP8_DTYPE
from kernels.kv_store import store_kv

PAGE_SIZE = 16
# (q heads, kv heads, head_dim, decode batch x context, extend new tokens after a prefix)
SHAPES = {
    "8b": (32, 8, 128, [(64, 2048), (8, 32768)], [(1024, 31744)]),
    "tiny": (4, 2, 64, [(8, 512), (1, 8192)], [(256, 4096)]),
}


@dataclass
class Timing:
    wall_ms: float
    cpu_ms: float | None  # on CUDA the host's time says nothing about the kernel's


@dataclass
class Row:
    kernel: str
    shape: str
    cache: str
    nbytes: int
    timing: Timing


def timed(fn: Callable[[], object], device: torch.device, repeats: int) -> Timing:
    """CUDA: triton's do_bench median. CPU: median wall and CPU time of `repeats` calls after a
    warm-up call (the machine may be shared: CPU time moves less with the load)."""
    if device.type == "cuda":
        return Timing(median_seconds(fn, device) * 1e3, None)
    fn()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return Timing(statistics.median(walls) * 1e3, statistics.median(cpus) * 1e3)


def paged_caches(kv_heads: int, head_dim: int, tokens: int, dtype, device, generator):
    """(k, v, page table of one row per request) over randomly ordered pages; float8 caches get
    per-head power-of-two scales (returned too, None for others)."""
    pages = -(-tokens // PAGE_SIZE)
    shape = (pages, PAGE_SIZE, kv_heads, head_dim)
    k, v = (torch.randn(shape, generator=generator).to(device) for _ in range(2))
    table = torch.randperm(pages, generator=generator).to(device=device, dtype=torch.int32)
    if dtype != FP8_DTYPE:
        return k.to(dtype), v.to(dtype), table, None
    scales = torch.full((kv_heads,), 2.0**-4, device=device)
    return (k / scales[:, None]).to(dtype), (v / scales[:, None]).to(dtype), table, scales


def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    error = (got.float() - want.float()).abs().max().item()
    tolerance = 1e-3 if got.dtype == torch.float32 else 3e-2
    if error > tolerance:
        raise SystemExit(f"{name}: max abs error {error:.3e} against the reference exceeds {tolerance}")


def bench_decode(heads, batch: int, context: int, dtype, device, repeats: int) -> Row:
    q_heads, kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(0)
    model_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k, v, pages, scales = paged_caches(kv_heads, head_dim, batch * context, dtype, device, g)
    table = pages.view(batch, -1)
    q = torch.randn(batch, q_heads, head_dim, generator=g).to(device=device, dtype=model_dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    args = (q, k, v, table, lens, head_dim**-0.5, scales, scales)
    check("decode", paged_decode_attention(*args), paged_decode_attention_reference(*args))
    nbytes = 2 * batch * context * kv_heads * head_dim * k.element_size()
    return Row(
        "decode attention",
        f"B={batch} ctx={context} {q_heads}q/{kv_heads}kv x {head_dim}",
        str(dtype),
        nbytes,
        timed(lambda: paged_decode_attention(*args), device, repeats),
    )


def bench_extend(heads, new: int, prefix: int, dtype, device, repeats: int) -> Row:
    q_heads, kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(1)
    model_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k, v, table, scales = paged_caches(kv_heads, head_dim, prefix + new, dtype, device, g)
    q = torch.randn(new, q_heads, head_dim, generator=g).to(device=device, dtype=model_dtype)
    cu = torch.tensor([0, new], dtype=torch.int32, device=device)
    prefix_lens = torch.tensor([prefix], dtype=torch.int32, device=device)
    args = (q, k, v, table[None], cu, prefix_lens, head_dim**-0.5, new, scales, scales)
    check("extend", paged_extend_attention(*args), paged_extend_attention_reference(*args))
    nbytes = 2 * (prefix + new) * kv_heads * head_dim * k.element_size()
    return Row(
        "extend attention",
        f"{new} new after {prefix} cached, {q_heads}q/{kv_heads}kv x {head_dim}",
        str(dtype),
        nbytes,
        timed(lambda: paged_extend_attention(*args), device, repeats),
    )


def bench_store(heads, tokens: int, dtype, device, repeats: int) -> Row:
    _, kv_heads, head_dim = heads
    g = torch.Generator().manual_seed(2)
    model_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    k_cache, v_cache, table, scales = paged_caches(kv_heads, head_dim, tokens, dtype, device, g)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g).to(device=device, dtype=model_dtype) for _ in range(2))
    slots = (table.long()[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=device)).flatten()[:tokens]
    nbytes = 2 * tokens * kv_heads * head_dim * (k.element_size() + k_cache.element_size())  # read and written
    return Row(
        "store_kv",
        f"T={tokens} {kv_heads}kv x {head_dim}",
        str(dtype),
        nbytes,
        timed(lambda: store_kv(k, v, k_cache, v_cache, slots, scales, scales), device, repeats),
    )


def print_table(rows: list[Row], device: torch.device, copy_bytes_per_s: float) -> None:
    name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\n{name}, torch {torch.__version__}; a large copy moves {copy_bytes_per_s / 1e9:,.1f} GB/s here\n")
    print(
        "| kernel | shape | KV cache | bytes | wall ms | CPU ms | GB/s (share of the copy's) | "
        "float8 speed-up (same run) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for base, fp8 in zip(rows[::2], rows[1::2]):
        for row in (base, fp8):
            rate = row.nbytes / (row.timing.wall_ms * 1e-3)
            cpu = "-" if row.timing.cpu_ms is None else f"{row.timing.cpu_ms:.3f}"
            speedup = f"{base.timing.wall_ms / fp8.timing.wall_ms:.2f}x" if row is fp8 else "baseline"
            print(
                f"| {row.kernel} | {row.shape} | {row.cache.removeprefix('torch.')} | {row.nbytes / 2**20:.1f} MiB | "
                f"{row.timing.wall_ms:.3f} | {cpu} | {rate / 1e9:,.1f} ({rate / copy_bytes_per_s:.0%}) | {speedup} |"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", choices=list(SHAPES), default=None, help="8b on CUDA, tiny on CPU, unless given")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row on CPU (median)")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q_heads, kv_heads, head_dim, decodes, extends = SHAPES[args.shapes or ("8b" if device.type == "cuda" else "tiny")]
    heads = (q_heads, kv_heads, head_dim)
    repeats = args.repeats
    baseline = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []  # each baseline row followed by its float8 row
    for batch, context in decodes:
        rows += [bench_decode(heads, batch, context, d, device, repeats) for d in (baseline, FP8_DTYPE)]
    for new, prefix in extends:
        rows += [bench_extend(heads, new, prefix, d, device, repeats) for d in (baseline, FP8_DTYPE)]
    rows += [bench_store(heads, 4096, d, device, repeats) for d in (baseline, FP8_DTYPE)]
    print_table(rows, device, copy_bandwidth(device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
