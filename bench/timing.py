"""Timing on the device the tensors live on, and the memory bandwidth the bandwidth figures are
shares of: measured in the same run (a large device-to-device copy), not taken from a datasheet."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

H100_DATASHEET_BYTES_PER_S = 3.35e12  # H100 SXM5 HBM3, for reference beside the measured figure
COPY_BYTES = {"cuda": 1 << 30, "cpu": 1 << 27}  # large enough to miss every cache


def median_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """On CUDA, triton's do_bench (device events, L2 flushed between runs); on CPU, the median of
    three wall-clock runs after one warm-up (the CPU rehearsal's figures mean nothing beyond that,
    and each interpreted call of a kernel takes up to a second there)."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e-3
    fn()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second read plus written by a copy of random data between two large buffers."""
    src = torch.randn(COPY_BYTES[device.type] // 4, device=device)  # random data: zeros can run faster
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device)
    return 2 * src.numel() * src.element_size() / seconds
