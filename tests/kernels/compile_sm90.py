"""Compile every kernel for an H100 (sm_90) on a machine without a GPU.

The interpreter accepts Python the Triton compiler rejects, so this checks the other half:
each launcher runs once at production shapes with its kernels swapped for recorders, and
every recorded launch is compiled ahead of time with ptxas (shipped in the triton wheel).
Prints one JSON line per compiled kernel: shared memory, registers and spill stack.
Run with TRITON_INTERPRET unset:  python -m tests.kernels.compile_sm90
"""

import importlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

# Modules by import_module: kernels/__init__ rebinds some module names to their dispatch functions.
(
    activation,
    decode_attention,
    extend_attention,
    fused_moe,
    kv_store,
    lora_expand,
    lora_shrink,
    moe_align,
    rms_norm,
    rope,
) = (
    importlib.import_module(f"kernels.{name}")
    for name in (
        "activation",
        "decode_attention",
        "extend_attention",
        "fused_moe",
        "kv_store",
        "lora_expand",
        "lora_shrink",
        "moe_align",
        "rms_norm",
        "rope",
    )
)
H100 = GPUTarget("cuda", 90, 32)
H100_SHARED_BYTES = 227 * 1024
_TENSOR_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.float8_e4m3fn: "*fp8e4nv",
    torch.int32: "*i32",
    torch.int64: "*i64",
}
_OPTIONS = ("num_warps", "num_stages")


class Recorder:
    """Stands in for a @triton.jit kernel and keeps each launch's arguments."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((self.kernel, args, kwargs))


def _signature(kernel, args, kwargs):
    """The signature, constexprs and alignment hints that a CUDA launch of these arguments gets."""
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, value) in enumerate(zip(kernel.arg_names, args)):
        specialized = name not in kernel.do_not_specialize
        if value is None:  # an unused pointer (the scales of a cache that is not float8)
            signature[name], constexprs[name] = "constexpr", None
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = _TENSOR_TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[name] = "i1"
            aligned = False
        elif isinstance(value, int):
            if value == 1 and specialized:  # the JIT specializes 1 into a constant
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0 and specialized
        else:
            signature[name] = "fp32"
            aligned = False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    for name in kernel.arg_names[len(args) :]:
        signature[name], constexprs[name] = "constexpr", kwargs[name]
    return signature, constexprs, attrs


def _resource_usage(cubin: bytes) -> dict:
    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = text.split("Resource usage:")[-1].split()
    return {
        k.lower(): int(v)
        for k, v in (item.split(":") for item in usage if ":" in item and item.split(":")[1].isdigit())
    }


def compile_launch(kernel, args, kwargs, dtype: torch.dtype) -> dict:
    signature, constexprs, attrs = _signature(kernel, args, kwargs)
    options = {k: kwargs[k] for k in _OPTIONS if k in kwargs}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=H100, options=options)
    usage = _resource_usage(compiled.asm["cubin"])
    return {
        "kernel": kernel.__name__,
        "dtype": str(dtype).replace("torch.", ""),
        **options,
        "shared_bytes": compiled.metadata.shared,
        "registers": usage["reg"],
        "spill_stack_bytes": usage["stack"],
    }


def production_launches() -> list:
    """(kernel, args, kwargs, model dtype) of each launch the launchers make at Qwen3-8B-like
    shapes (128-dim heads, 32 q / 8 kv heads), and the fused MoE's at Qwen3-30B-A3B's."""
    launches: list = []
    modules = (
        rms_norm,
        rope,
        activation,
        kv_store,
        decode_attention,
        extend_attention,
        moe_align,
        fused_moe,
        lora_shrink,
        lora_expand,
    )
    for module in modules:
        for name, value in vars(module).items():
            if isinstance(value, triton.runtime.jit.JITFunction) and name.startswith("_") and name.endswith("_kernel"):
                setattr(module, name, Recorder(value, launches))
    recorded = []
    for dtype in (torch.bfloat16, torch.float32):
        _record_all(dtype)
        recorded += [(*launch, dtype) for launch in launches]
        launches.clear()
        _record_fp8_cache(dtype)
        recorded += [(*launch, f"{dtype}, float8 KV cache") for launch in launches]
        launches.clear()
    return recorded


def _record_fp8_cache(dtype: torch.dtype) -> None:
    """The launches that read or write a float8 KV cache (kernels/fp8.py)."""
    t, hq, hk, d, pages, page_size = 8, 32, 8, 128, 64, 16
    q, k, v = (torch.randn(t, h, d, dtype=dtype) for h in (hq, hk, hk))
    cache = torch.zeros(pages, page_size, hk, d, dtype=torch.float8_e4m3fn)
    scales = torch.ones(hk)
    kv_store.store_kv_triton(k, v, cache, cache.clone(), torch.arange(t), scales, scales)
    page_table = torch.arange(pages, dtype=torch.int32).view(2, -1)
    decode_attention.paged_decode_attention_triton(
        q[:2].contiguous(),
        cache,
        cache.clone(),
        page_table,
        torch.tensor([300, 17], dtype=torch.int32),
        d**-0.5,
        scales,
        scales,
    )
    extend_attention.paged_extend_attention_triton(
        q,
        cache,
        cache.clone(),
        page_table,
        torch.tensor([0, 3, 8], dtype=torch.int32),
        torch.tensor([5, 40], dtype=torch.int32),
        d**-0.5,
        5,
        scales,
        scales,
    )


def _record_all(dtype: torch.dtype) -> None:
    t, hidden, hq, hk, d, pages, page_size = 8, 4096, 32, 8, 128, 64, 16
    x = torch.randn(t, hidden, dtype=dtype)
    rms_norm.rms_norm_triton(x, torch.ones(hidden, dtype=dtype), 1e-6)
    rms_norm.fused_add_rms_norm_triton(x, x, torch.ones(hidden, dtype=dtype), 1e-6)
    qkv = torch.randn(t, (hq + 2 * hk) * d, dtype=dtype)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k, v = q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)
    positions = torch.arange(t)
    cos_sin = rope.rope_cos_sin_cache(d, 64, 1e6)
    rope.qk_norm_rope_triton(q, k, torch.ones(d, dtype=dtype), torch.ones(d, dtype=dtype), positions, cos_sin, 1e-6)
    activation.silu_and_mul_triton(torch.randn(t, 2 * 12288, dtype=dtype))
    cache = torch.zeros(pages, page_size, hk, d, dtype=dtype)
    kv_store.store_kv_triton(k, v, cache, cache.clone(), torch.arange(t))
    page_table = torch.arange(pages, dtype=torch.int32).view(2, -1)
    decode_attention.paged_decode_attention_triton(
        q[:2].contiguous(), cache, cache.clone(), page_table, torch.tensor([300, 17], dtype=torch.int32), d**-0.5
    )
    extend_attention.paged_extend_attention_triton(
        q.contiguous(),
        cache,
        cache.clone(),
        page_table,
        torch.tensor([0, 3, 8], dtype=torch.int32),
        torch.tensor([5, 40], dtype=torch.int32),
        d**-0.5,
        5,
    )
    _record_fused_moe(dtype)
    _record_lora(dtype)


def _record_lora(dtype: torch.dtype) -> None:
    """Adapters of rank 64 in 8 slots on Qwen3-8B's qkv projection (hidden 4096; q 4096, k and v
    1024 each), at a decode batch and a prefill step: the launcher's smallest and largest blocks."""
    slots, rank, hidden, slices = 8, 64, 4096, (0, 4096, 5120, 6144)
    a, b = torch.empty(slots, 3 * rank, hidden, dtype=dtype), torch.empty(slots, slices[-1], rank, dtype=dtype)
    ranks, scales = torch.full((slots, 3), rank, dtype=torch.int32), torch.ones(slots, 3)
    for tokens in (64, 4096):
        rows = torch.arange(tokens)
        ends = torch.full((slots,), tokens, dtype=torch.int32)
        shrunk = lora_shrink.lora_shrink_triton(torch.zeros(tokens, hidden, dtype=dtype), a, rows, ends, ranks)
        out = torch.zeros(tokens, slices[-1], dtype=dtype)
        lora_expand.lora_expand_triton(shrunk, b, out, rows, ends, ranks, scales, slices)


def _record_fused_moe(dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B's experts (128 of hidden 2048 and intermediate 768, 8 per token) at a decode
    batch, a mid-size step and a prefill step: the three block sizes the launcher picks. The
    weights are allocated, never touched (only their strides reach the compiler)."""
    experts, hidden, inter, top_k = 128, 2048, 768, 8
    w13, w2 = torch.empty(experts, 2 * inter, hidden, dtype=dtype), torch.empty(experts, hidden, inter, dtype=dtype)
    for tokens in (64, 1024, 8192):
        ids = torch.randint(0, experts, (tokens, top_k))
        weights = torch.full((tokens, top_k), 1 / top_k, dtype=dtype)
        fused_moe.fused_moe_triton(torch.zeros(tokens, hidden, dtype=dtype), w13, w2, weights, ids)


def main() -> int:
    failures = 0
    for kernel, args, kwargs, dtype in production_launches():
        try:
            report = compile_launch(kernel, args, kwargs, dtype)
        except Exception as e:  # report every kernel, not just the first failure
            report, failures = {"kernel": kernel.__name__, "error": repr(e)[:2000]}, failures + 1
        print(json.dumps(report), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
