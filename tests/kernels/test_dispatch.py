"""The dispatch functions the model calls pick Triton exactly when use_triton says so."""

import importlib

import pytest
import torch

import kernels


def op_args(device: str) -> dict:
    """Each dispatched op: its module and well-formed arguments (their values do not matter here)."""
    t, h, d = 3, 2, 64
    x, w = torch.zeros(t, h * d, device=device), torch.ones(h * d, device=device)
    q = torch.zeros(t, h, d, device=device)
    cache = torch.zeros(4, 16, h, d, device=device)
    table = torch.zeros(t, 1, dtype=torch.int32, device=device)
    lens = torch.ones(t, dtype=torch.int32, device=device)
    return {
        "rms_norm": ("rms_norm", (x, w, 1e-6)),
        "fused_add_rms_norm": ("rms_norm", (x, x, w, 1e-6)),
        "qk_norm_rope": (
            "rope",
            (
                q,
                q,
                w[:d],
                w[:d],
                torch.zeros(t, dtype=torch.int64, device=device),
                torch.zeros(8, d, device=device),
                1e-6,
            ),
        ),
        "silu_and_mul": ("activation", (x,)),
        "store_kv": ("kv_store", (q, q, cache, cache.clone(), torch.arange(t, device=device))),
        "paged_decode_attention": ("decode_attention", (q, cache, cache, table, lens, 0.125)),
        "paged_extend_attention": (
            "extend_attention",
            (
                q,
                cache,
                cache,
                table,
                torch.arange(t + 1, dtype=torch.int32, device=device),
                torch.zeros(t, dtype=torch.int32, device=device),
                0.125,
                1,
            ),
        ),
    }


# The float32 ops with a numba-compiled CPU kernel; the others run their torch reference on CPU.
CPU_KERNELS = {"paged_decode_attention"}


def record_calls(op: str, module_name: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    module = importlib.import_module(f"kernels.{module_name}")
    for path in ("triton", "cpu", "reference"):
        if hasattr(module, f"{op}_{path}"):
            monkeypatch.setattr(module, f"{op}_{path}", lambda *args, path=path: calls.append(path))
    return calls


@pytest.mark.parametrize("op", list(op_args("cpu")))
def test_dispatch_runs_triton_on_cuda_or_under_the_interpreter(op, device, monkeypatch):
    module_name, args = op_args(device)[op]
    calls = record_calls(op, module_name, monkeypatch)
    getattr(kernels, op)(*args)
    assert calls == ["triton"]


@pytest.mark.parametrize("op", list(op_args("cpu")))
def test_dispatch_runs_the_cpu_paths_without_the_interpreter(op, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    module_name, args = op_args("cpu")[op]
    calls = record_calls(op, module_name, monkeypatch)
    getattr(kernels, op)(*args)
    assert calls == ["cpu" if op in CPU_KERNELS else "reference"]


def test_dispatch_runs_the_decode_reference_for_a_16_bit_cache_on_cpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    _, args = op_args("cpu")["paged_decode_attention"]
    calls = record_calls("paged_decode_attention", "decode_attention", monkeypatch)
    kernels.paged_decode_attention(*(a.bfloat16() if a.is_floating_point() else a for a in args[:3]), *args[3:])
    assert calls == ["reference"]
