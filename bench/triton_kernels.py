"""Each Triton kernel against its torch baseline on one CUDA GPU, at the issue's shapes.

    python -m bench.triton_kernels            # bf16; prints a markdown table for bench/RESULTS.md

Times are medians of triton.testing.do_bench (L2 flushed between runs). Memory-bound
kernels report achieved HBM bandwidth (bytes that must move / time) against the H100's
3.35 TB/s; extend attention reports useful causal TFLOP/s against torch SDPA (flash
backend, K/V heads expanded so it runs as plain MHA) on the same shapes. Every kernel's
output is checked against its reference before it is timed.
"""
import argparse
import logging
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
import triton.testing

from kernels.activation import silu_and_mul_reference, silu_and_mul_triton
from kernels.decode_attention import (
    decode_num_splits, paged_decode_attention_reference, paged_decode_attention_triton,
)
from kernels.extend_attention import paged_extend_attention_reference, paged_extend_attention_triton
from kernels.kv_store import store_kv_reference, store_kv_triton
from kernels.rms_norm import (
    fused_add_rms_norm_reference, fused_add_rms_norm_triton, rms_norm_reference, rms_norm_triton,
)
from kernels.rope import qk_norm_rope_reference, qk_norm_rope_triton, rope_cos_sin_cache

log = logging.getLogger("bench.triton_kernels")

H100_HBM_BYTES_PER_S = 3.35e12
H100_BF16_DENSE_FLOPS = 989e12
# Qwen3-8B's shapes: hidden 4096, MLP 12288, 32 q heads and 8 kv heads of 128.
HIDDEN, INTER, Q_HEADS, KV_HEADS, HEAD_DIM = 4096, 12288, 32, 8, 128
LARGE_T = 16384
PAGE_SIZE = 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cuda"


@dataclass
class Row:
    kernel: str
    shape: str
    ms: float
    baseline: str
    baseline_ms: float
    rate: str  # achieved figure vs the card's peak
    target: str


def median_ms(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float) -> None:
    error = (got.float() - want.float()).abs().max().item()
    if error > atol:
        raise SystemExit(f"{name}: max abs error {error:.3e} vs reference exceeds {atol}")
    log.info("%s: max abs error %.3e", name, error)


def bandwidth(name: str, shape: str, ms: float, baseline: str, baseline_ms: float, nbytes: int, target: float) -> Row:
    achieved = nbytes / (ms * 1e-3)
    share = achieved / H100_HBM_BYTES_PER_S
    met = "met" if share >= target else "NOT met"
    return Row(name, shape, ms, baseline, baseline_ms, f"{achieved / 1e9:.0f} GB/s = {share:.0%} of HBM",
               f">= {target:.0%} HBM: {met}" if target else "-")


def bench_rms_norm(dtype) -> list[Row]:
    x = torch.randn(LARGE_T, HIDDEN, dtype=dtype, device=DEVICE)
    residual = torch.randn_like(x)
    w = torch.randn(HIDDEN, dtype=dtype, device=DEVICE)
    check("rms_norm", rms_norm_triton(x, w, 1e-6), rms_norm_reference(x, w, 1e-6), 3e-2)
    check("fused_add_rms_norm", fused_add_rms_norm_triton(x, residual, w, 1e-6)[0],
          fused_add_rms_norm_reference(x, residual, w, 1e-6)[0], 3e-2)
    shape = f"T={LARGE_T} H={HIDDEN}"
    size = x.numel() * x.element_size()
    return [
        bandwidth("rms_norm", shape, median_ms(lambda: rms_norm_triton(x, w, 1e-6)),
                  "torch reference", median_ms(lambda: rms_norm_reference(x, w, 1e-6)), 2 * size, 0.7),
        bandwidth("fused_add_rms_norm", shape, median_ms(lambda: fused_add_rms_norm_triton(x, residual, w, 1e-6)),
                  "torch reference", median_ms(lambda: fused_add_rms_norm_reference(x, residual, w, 1e-6)),
                  4 * size, 0.7),
    ]


def bench_silu_and_mul(dtype) -> list[Row]:
    x = torch.randn(LARGE_T, 2 * INTER, dtype=dtype, device=DEVICE)
    check("silu_and_mul", silu_and_mul_triton(x), silu_and_mul_reference(x), 3e-2)
    return [bandwidth("silu_and_mul", f"T={LARGE_T} I={INTER}", median_ms(lambda: silu_and_mul_triton(x)),
                      "torch reference", median_ms(lambda: silu_and_mul_reference(x)),
                      3 * x.numel() // 2 * x.element_size(), 0.7)]


def bench_qk_norm_rope(dtype) -> list[Row]:
    qkv = torch.randn(LARGE_T, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, device=DEVICE)
    q, k, _ = qkv.split([Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k = q.view(LARGE_T, Q_HEADS, HEAD_DIM), k.view(LARGE_T, KV_HEADS, HEAD_DIM)
    w = torch.ones(HEAD_DIM, dtype=dtype, device=DEVICE)
    positions = torch.randint(0, 32768, (LARGE_T,), device=DEVICE)
    cos_sin = rope_cos_sin_cache(HEAD_DIM, 32768, 1e6, device=DEVICE)
    args = (q, k, w, w, positions, cos_sin, 1e-6)
    got, want = qk_norm_rope_triton(*args), qk_norm_rope_reference(*args)
    check("qk_norm_rope", torch.cat([got[0], got[1]], 1), torch.cat([want[0], want[1]], 1), 3e-2)
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + LARGE_T * HEAD_DIM * 4
    return [bandwidth("qk_norm_rope", f"T={LARGE_T} {Q_HEADS}q+{KV_HEADS}kv x {HEAD_DIM}",
                      median_ms(lambda: qk_norm_rope_triton(*args)), "torch reference",
                      median_ms(lambda: qk_norm_rope_reference(*args)), nbytes, 0)]


def bench_store_kv(dtype) -> list[Row]:
    k = torch.randn(LARGE_T, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    v = torch.randn_like(k)
    num_pages = LARGE_T // PAGE_SIZE
    k_cache = torch.zeros(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_pages, device=DEVICE)[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=DEVICE)
    slots = slots.flatten()
    store_kv_triton(k, v, k_cache, v_cache, slots)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    store_kv_reference(k, v, want_k, want_v, slots)
    check("store_kv", torch.stack([k_cache, v_cache]), torch.stack([want_k, want_v]), 0.0)
    return [bandwidth("store_kv", f"T={LARGE_T} {KV_HEADS}kv x {HEAD_DIM}",
                      median_ms(lambda: store_kv_triton(k, v, k_cache, v_cache, slots)), "torch reference",
                      median_ms(lambda: store_kv_reference(k, v, k_cache, v_cache, slots)),
                      4 * k.numel() * k.element_size(), 0)]


def scattered_cache(lengths: list[int], dtype):
    pages_each = [-(-n // PAGE_SIZE) for n in lengths]
    num_pages = sum(pages_each)
    k_cache = torch.randn(num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(num_pages, device=DEVICE).to(torch.int32).view(len(lengths), -1)
    return k_cache, v_cache, page_table


def contiguous_mha(cache: torch.Tensor, page_table: torch.Tensor, length: int) -> torch.Tensor:
    """[B, Q_HEADS, length, D]: the paged rows gathered in order, kv heads repeated per q head."""
    rows = cache[page_table.long()].reshape(page_table.shape[0], -1, KV_HEADS, HEAD_DIM)[:, :length]
    return rows.transpose(1, 2).repeat_interleave(Q_HEADS // KV_HEADS, 1).contiguous()


def bench_decode(dtype, batch: int = 64, context: int = 2048) -> list[Row]:
    k_cache, v_cache, page_table = scattered_cache([context] * batch, dtype)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    check("paged_decode_attention", paged_decode_attention_triton(q, k_cache, v_cache, page_table, lens, scale),
          paged_decode_attention_reference(q, k_cache, v_cache, page_table, lens, scale), 3e-2)
    # The same attention on contiguous K/V (no paging), as torch's fused SDPA runs it.
    k, v = contiguous_mha(k_cache, page_table, context), contiguous_mha(v_cache, page_table, context)
    q4 = q[:, :, None, :]
    splits = decode_num_splits(batch, KV_HEADS, page_table.shape[1] * PAGE_SIZE, q.device)
    ms = median_ms(lambda: paged_decode_attention_triton(q, k_cache, v_cache, page_table, lens, scale))
    nbytes = 2 * k_cache.numel() * k_cache.element_size()
    shape = f"B={batch} ctx={context} {Q_HEADS}q/{KV_HEADS}kv x {HEAD_DIM}, {splits} split(s)"
    return [
        bandwidth("paged_decode_attention", shape, ms, "torch reference (per-request loop)",
                  median_ms(lambda: paged_decode_attention_reference(q, k_cache, v_cache, page_table, lens, scale)),
                  nbytes, 0.6),
        bandwidth("paged_decode_attention", shape, ms, "torch SDPA, contiguous K/V expanded to MHA",
                  median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, scale=scale)), nbytes, 0.6),
    ]


def bench_extend(dtype, batch: int = 8, q_len: int = 1024) -> list[Row]:
    k_cache, v_cache, page_table = scattered_cache([q_len] * batch, dtype)
    q = torch.randn(batch * q_len, Q_HEADS, HEAD_DIM, dtype=dtype, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE) * q_len
    prefix = torch.zeros(batch, dtype=torch.int32, device=DEVICE)
    scale = HEAD_DIM**-0.5
    args = (q, k_cache, v_cache, page_table, cu, prefix, scale, q_len)
    check("paged_extend_attention", paged_extend_attention_triton(*args), paged_extend_attention_reference(*args), 3e-2)
    q4 = q.view(batch, q_len, Q_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    k, v = contiguous_mha(k_cache, page_table, q_len), contiguous_mha(v_cache, page_table, q_len)
    ms = median_ms(lambda: paged_extend_attention_triton(*args))
    sdpa_ms = median_ms(lambda: F.scaled_dot_product_attention(q4, k, v, is_causal=True, scale=scale))
    flops = 2 * batch * Q_HEADS * q_len * q_len * HEAD_DIM  # QK^T and PV over the causal half
    ours, sdpa = flops / (ms * 1e-3), flops / (sdpa_ms * 1e-3)
    met = "met" if ours >= 0.5 * sdpa else "NOT met"
    return [Row("paged_extend_attention", f"B={batch} x {q_len} new, prefix 0, {Q_HEADS}q/{KV_HEADS}kv x {HEAD_DIM}",
                ms, "torch SDPA causal, contiguous, MHA", sdpa_ms,
                f"{ours / 1e12:.0f} TFLOP/s = {ours / H100_BF16_DENSE_FLOPS:.0%} of peak; SDPA {sdpa / 1e12:.0f}",
                f">= 50% of SDPA: {met} ({ours / sdpa:.0%})")]


def print_table(rows: list[Row], device_name: str, dtype_name: str) -> None:
    print(f"\n{device_name}, {dtype_name}, torch {torch.__version__}\n")
    print("| kernel | shape | triton ms | baseline | baseline ms | speedup | achieved | target |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.kernel} | {r.shape} | {r.ms:.3f} | {r.baseline} | {r.baseline_ms:.3f} | "
              f"{r.baseline_ms / r.ms:.2f}x | {r.rate} | {r.target} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        print("bench/triton_kernels.py needs a CUDA GPU (the figures are HBM bandwidth and tensor-core rates); "
              "on CPU the kernels are checked by the interpreter tests: pytest tests/kernels")
        return 0
    dtype = DTYPES[args.dtype]
    rows = []
    for bench in (bench_rms_norm, bench_silu_and_mul, bench_qk_norm_rope, bench_store_kv, bench_decode, bench_extend):
        rows += bench(dtype)
        torch.cuda.empty_cache()
    print_table(rows, torch.cuda.get_device_name(), args.dtype)
    return 0


if __name__ == "__main__":
    sys.exit(main())
