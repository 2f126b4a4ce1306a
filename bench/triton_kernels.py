"""Each Triton kernel against its torch baseline, at a model's shapes, on one CUDA GPU.

    python -m bench.triton_kernels                        # qwen3-0.6b's shapes, bf16; a markdown table for bench/RESULTS.md
    python -m bench.triton_kernels --shape qwen3-8b       # Qwen3-8B's
    python -m bench.triton_kernels --shape tiny --dtype fp32    # without CUDA: interpreted on the CPU (a rehearsal, not figures)

Times are medians of triton.testing.do_bench (L2 flushed between runs). Memory-bound kernels
report achieved bandwidth (bytes that must move / time) as a share of the bandwidth a large
device-to-device copy reaches in the same run; extend attention reports useful causal TFLOP/s
against torch SDPA (flash backend, K/V heads expanded so it runs as plain MHA) on the same
shapes. Every kernel's output is checked against its reference before it is timed. Without CUDA
only `--shape tiny` runs (Triton's interpreter on CPU tensors, wall-clock medians); any other
shape exits with status 77 (skipped).
"""

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

# triton.jit picks compiled or interpreted when a kernel is defined, so before kernels/ is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F

from bench.timing import H100_DATASHEET_BYTES_PER_S, copy_bandwidth, median_seconds
from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.decode_attention import (
    decode_num_splits,
    paged_decode_attention_reference,
    paged_decode_attention_triton,
)
from kernels.extend_attention import paged_extend_attention_reference, paged_extend_attention_triton
from kernels.kv_store import store_kv_reference, store_kv_triton
from kernels.rms_norm import (
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)
from kernels.rope import qk_norm_rope_reference, qk_norm_rope_triton, rope_cos_sin_cache

log = logging.getLogger("bench.triton_kernels")

EXIT_SKIPPED = 77
H100_BF16_DENSE_FLOPS = 989e12
PAGE_SIZE = 16
# fp32 for the CPU: Triton's interpreter truncates float32 to bf16 where the GPU rounds to nearest.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Shapes:
    hidden: int
    inter: int
    q_heads: int
    kv_heads: int
    head_dim: int
    tokens: int  # rows of the elementwise kernels
    decode: tuple[tuple[int, int], ...]  # (batch, context) of each decode attention row
    extend: tuple[int, int]  # (batch, new tokens) of extend attention


SHAPES = {
    # Decode at the batches the decode kernel's tuning is judged at (issue 34), the context of bench/decode_step.py.
    "qwen3-0.6b": Shapes(1024, 3072, 16, 8, 128, 16384, ((16, 1024), (64, 1024), (256, 1024)), (8, 1024)),
    "qwen3-8b": Shapes(4096, 12288, 32, 8, 128, 16384, ((64, 2048),), (8, 1024)),
    "tiny": Shapes(64, 128, 4, 2, 32, 64, ((16, 40),), (2, 16)),
}


@dataclass(frozen=True)
class Bench:
    """What every measurement shares: where it runs and the bandwidth its shares are of."""

    shapes: Shapes
    dtype: torch.dtype
    device: torch.device
    bandwidth: float  # bytes/s of a large copy, measured in this run

    def median_ms(self, fn: Callable[[], object]) -> float:
        return median_seconds(fn, self.device) * 1e3


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float
    baseline: str
    baseline_ms: float
    rate: str  # achieved figure vs the card's peak
    target: str


def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    """Each element within `atol` plus two rounding steps of the output's dtype at the reference's
    magnitude: the references round in between, as transformers does (RMSNorm casts before its
    weight), the kernels once at the end. On the H200 a bare 0.03 failed qk_norm_rope at 0.03125,
    one bf16 ulp of a value in [4, 8)."""
    error = (got.float() - want.float()).abs()
    allowed = atol + 2 * torch.finfo(want.dtype).eps * want.float().abs()
    if bool((error > allowed).any()):
        worst = int((error - allowed).argmax())
        raise SystemExit(
            f"{name}: error {error.flatten()[worst].item():.3e} at a reference value of "
            f"{want.flatten()[worst].item():.3e} exceeds {atol} + two {want.dtype} rounding steps"
        )
    log.info("%s: max abs error %.3e", name, error.max().item())


def bandwidth_row(
    b: Bench, name: str, shape: str, ms: float, baseline: str, baseline_ms: float, nbytes: int, target: float
) -> Row:
    achieved = nbytes / (ms * 1e-3)
    share = achieved / b.bandwidth
    met = "met" if share >= target else "NOT met"
    return Row(
        name,
        shape,
        ms,
        baseline,
        baseline_ms,
        f"{achieved / 1e9:,.0f} GB/s = {share:.0%} of the copy's",
        f">= {target:.0%}: {met}" if target else "-",
    )


def bench_rms_norm(b: Bench) -> list[Row]:
    t, h = b.shapes.tokens, b.shapes.hidden
    x = torch.randn(t, h, dtype=b.dtype, device=b.device)
    residual = torch.randn_like(x)
    w = torch.randn(h, dtype=b.dtype, device=b.device)
    check("rms_norm", rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), 3e-2)
    check(
        "fused_add_rms_norm",
        fused_add_rms_norm_triton(x, residual, w, 1e-6)[0],
        fused_add_rms_norm_reference(x, residual, w, 1e-6)[0],
        3e-2,
    )
    shape = f"T={t} H={h}"
    size = x.numel() * x.element_size()
    return [
        bandwidth_row(
            b,
            "rms_norm",
            shape,
            b.median_ms(lambda: rms_norm_triton(x, w, 1e-6)),
            "torch reference",
            b.median_ms(lambda: rms_norm_reference(x, w, 1e-6)),
            2 * size,
            0.7,
        ),
        bandwidth_row(
            b,
            "fused_add_rms_norm",
            shape,
            b.median_ms(lambda: fused_add_rms_norm_triton(x, residual, w, 1e-6)),
            "torch reference",
            b.median_ms(lambda: fused_add_rms_norm_reference(x, residual, w, 1e-6)),
            4 * size,
            0.7,
        ),
    ]


def bench_silu_and_mul(b: Bench) -> list[Row]:
    t, inter = b.shapes.tokens, b.shapes.inter
    x = torch.randn(t, 2 * inter, dtype=b.dtype, device=b.device)
    check("silu_and_mul", silu_and_mul_triton(x), silu_and_mul_reference(x), 3e-2)
    return [
        bandwidth_row(
            b,
            "silu_and_mul",
            f"T={t} I={inter}",
            b.median_ms(lambda: silu_and_mul_triton(x)),
            "torch reference",
            b.median_ms(lambda: silu_and_mul_reference(x)),
            3 * x.numel() // 2 * x.element_size(),
            0.7,
        )
    ]


def bench_qk_norm_rope(b: Bench) -> list[Row]:
    s = b.shapes
    qkv = torch.randn(s.tokens, (s.q_heads + 2 * s.kv_heads) * s.head_dim, dtype=b.dtype, device=b.device)
    q, k, _ = qkv.split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
    q, k = q.view(s.tokens, s.q_heads, s.head_dim), k.view(s.tokens, s.kv_heads, s.head_dim)
    w = torch.ones(s.head_dim, dtype=b.dtype, device=b.device)
    positions = torch.randint(0, 32768, (s.tokens,), device=b.device)
    cos_sin = rope_cos_sin_cache(s.head_dim, 32768, 1e6, device=b.device)
    args = (q, k, w, w, positions, cos_sin, 1e-6)
    got, want = qk_norm_rope_triton(*args), qk_norm_rope_reference(*args)
    check("qk_norm_rope", torch.cat([got[0], got[1]], 1), torch.cat([want[0], want[1]], 1), 3e-2)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + s.tokens * s.head_dim * 4
    return [
        bandwidth_row(
            b,
            "qk_norm_rope",
            f"T={s.tokens} {s.q_heads}q+{s.kv_heads}kv x {s.head_dim}",
            b.median_ms(lambda: qk_norm_rope_triton(*args)),
            "torch reference",
            b.median_ms(lambda: qk_norm_rope_reference(*args)),
            nbytes,
            0,
        )
    ]


def bench_store_kv(b: Bench) -> list[Row]:
    s = b.shapes
    k = torch.randn(s.tokens, s.kv_heads, s.head_dim, dtype=b.dtype, device=b.device)
    v = torch.randn_like(k)
    num_pages = s.tokens // PAGE_SIZE
    k_cache = torch.zeros(num_pages, PAGE_SIZE, s.kv_heads, s.head_dim, dtype=b.dtype, device=b.device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_pages, device=b.device)[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=b.device)
    slots = slots.flatten()
    store_kv_triton(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_reference(k, v, want_k, want_v, slots)
    check("store_kv", torch.stack([k_cache, v_cache]), torch.stack([want_k, want_v]), 0.0)
    return [
        bandwidth_row(
            b,
            "store_kv",
            f"T={s.tokens} {s.kv_heads}kv x {s.head_dim}",
            b.median_ms(lambda: store_kv_triton(k, v, k_cache, v_cache, slots)),
            "torch reference",
            b.median_ms(lambda: store_kv_reference(k, v, k_cache, v_cache, slots)),
            4 * k.numel() * k.element_size(),
            0,
        )
    ]


def scattered_cache(b: Bench, lengths: list[int]):
    s = b.shapes
    pages_each = [-(-n // PAGE_SIZE) for n in lengths]
    num_pages = sum(pages_each)
    k_cache = torch.randn(num_pages, PAGE_SIZE, s.kv_heads, s.head_dim, dtype=b.dtype, device=b.device)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(num_pages, device=b.device).to(torch.int32).view(len(lengths), -1)
    return k_cache, v_cache, page_table


def contiguous_mha(s: Shapes, cache: torch.Tensor, page_table: torch.Tensor, length: int) -> torch.Tensor:
    """[B, q heads, length, D]: the paged rows gathered in order, kv heads repeated per q head."""
    rows = cache[page_table.long()].reshape(page_table.shape[0], -1, s.kv_heads, s.head_dim)[:, :length]
    return rows.transpose(1, 2).repeat_interleave(s.q_heads // s.kv_heads, 1).contiguous()


def bench_decode(b: Bench) -> list[Row]:
    return [row for batch, context in b.shapes.decode for row in bench_decode_at(b, batch, context)]


def bench_decode_at(b: Bench, batch: int, context: int) -> list[Row]:
    s = b.shapes
    k_cache, v_cache, page_table = scattered_cache(b, [context] * batch)
    q = torch.randn(batch, s.q_heads, s.head_dim, dtype=b.dtype, device=b.device)
    lens = torch.full((batch,), context, dtype=torch.int32, device=b.device)
    scale = s.head_dim**-0.5
    args = (q, k_cache, v_cache, page_table, lens, scale)
    check("paged_decode_attention", paged_decode_attention_triton(*args), paged_decode_attention_reference(*args), 3e-2)
    # The same attention on contiguous K/V (no paging), as torch's fused SDPA runs it.
    k, v = contiguous_mha(s, k_cache, page_table, context), contiguous_mha(s, v_cache, page_table, context)
    q4 = q[:, :, None, :]
    splits = decode_num_splits(batch, s.kv_heads, page_table.shape[1] * PAGE_SIZE, q.device)
    ms = b.median_ms(lambda: paged_decode_attention_triton(*args))
    nbytes = 2 * k_cache.numel() * k_cache.element_size()
    shape = f"B={batch} ctx={context} {s.q_heads}q/{s.kv_heads}kv x {s.head_dim}, {splits} split(s)"
    return [
        bandwidth_row(
            b,
            "paged_decode_attention",
            shape,
            ms,
            "torch reference (per-request loop)",
            b.median_ms(lambda: paged_decode_attention_reference(*args)),
            nbytes,
            0.6,
        ),
        bandwidth_row(
            b,
            "paged_decode_attention",
            shape,
            ms,
            "torch SDPA, contiguous K/V expanded to MHA",
            b.median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale)),
            nbytes,
            0.6,
        ),
    ]


def bench_extend(b: Bench) -> list[Row]:
    s = b.shapes
    batch, q_len = s.extend
    k_cache, v_cache, page_table = scattered_cache(b, [q_len] * batch)
    q = torch.randn(batch * q_len, s.q_heads, s.head_dim, dtype=b.dtype, device=b.device)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=b.device) * q_len
    prefix = torch.zeros(batch, dtype=torch.int32, device=b.device)
    scale = s.head_dim**-0.5
    args = (q, k_cache, v_cache, page_table, cu, prefix, scale, q_len)
    check("paged_extend_attention", paged_extend_attention_triton(*args), paged_extend_attention_reference(*args), 3e-2)
    q4 = q.view(batch, q_len, s.q_heads, s.head_dim).transpose(1, 2).contiguous()
    k, v = contiguous_mha(s, k_cache, page_table, q_len), contiguous_mha(s, v_cache, page_table, q_len)
    ms = b.median_ms(lambda: paged_extend_attention_triton(*args))
    sdpa_ms = b.median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale))
    flops = 2 * batch * s.q_heads * q_len * q_len * s.head_dim  # QK^T and PV over the causal half
    ours, sdpa = flops / (ms * 1e-3), flops / (sdpa_ms * 1e-3)
    met = "met" if ours >= 0.5 * sdpa else "NOT met"
    return [
        Row(
            "paged_extend_attention",
            f"B={batch} x {q_len} new, prefix 0, {s.q_heads}q/{s.kv_heads}kv x {s.head_dim}",
            ms,
            "torch SDPA causal, contiguous, MHA",
            sdpa_ms,
            f"{ours / 1e12:.3g} TFLOP/s = {ours / H100_BF16_DENSE_FLOPS:.0%} of H100 peak; SDPA {sdpa / 1e12:.3g}",
            f">= 50% of SDPA: {met} ({ours / sdpa:.0%})",
        )
    ]


def print_table(rows: list[Row], b: Bench, device_name: str, dtype_name: str, shape_name: str) -> None:
    print(f"\n{device_name}, {dtype_name}, {shape_name} shapes, torch {torch.__version__}")
    print(
        f"measured copy bandwidth: {b.bandwidth / 1e9:,.0f} GB/s (read + written; "
        f"the H100 datasheet's HBM3: {H100_DATASHEET_BYTES_PER_S / 1e9:,.0f} GB/s)\n"
    )
    print("| kernel | shape | triton ms | baseline | baseline ms | speedup | achieved | target |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r.kernel} | {r.shape} | {r.ms:.3f} | {r.baseline} | {r.baseline_ms:.3f} | "
            f"{r.baseline_ms / r.ms:.2f}x | {r.rate} | {r.target} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-0.6b")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda = torch.cuda.is_available()
    if not cuda and args.shape != "tiny":
        print(
            f"bench.triton_kernels needs a CUDA GPU at the {args.shape} shapes (the figures are HBM bandwidth and "
            "tensor-core rates); --shape tiny runs the same checks and table interpreted on the CPU"
        )
        return EXIT_SKIPPED
    device = torch.device("cuda" if cuda else "cpu")
    b = Bench(SHAPES[args.shape], DTYPES[args.dtype], device, copy_bandwidth(device))
    rows = []
    for bench in (bench_rms_norm, bench_silu_and_mul, bench_qk_norm_rope, bench_store_kv, bench_decode, bench_extend):
        rows += bench(b)
        if cuda:
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if cuda else "CPU, Triton interpreter (not GPU figures)"
    print_table(rows, b, device_name, args.dtype, args.shape)
    return 0


if __name__ == "__main__":
    sys.exit(main())
