"""Kernel tests: each Triton kernel against its torch reference, compiled on CUDA or through
Triton's interpreter on CPU.

tests/conftest.py imported triton and kernels/ in interpreter mode; the `device` fixture sets
TRITON_INTERPRET for one test at a time, so the rest of a `pytest tests` run keeps the
reference path. Tolerances per dtype are below; the largest error each kernel reached in
the run is printed at the end (pytest's terminal summary).
"""

import importlib
import inspect

import numpy as np
import pytest
import torch
import triton.language as tl
from triton.runtime import interpreter

# |actual - expected| <= atol + rtol * |expected|. fp32 allows last-bit differences from
# summation order and rsqrt/exp2; 16-bit allows a rounding flip of an O(1) value, and in
# attention the bf16 rounding of softmax weights before P @ V (as every flash kernel does).
TOLERANCES = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}
MAX_ERRORS = pytest.StashKey[dict]()


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    # torch rounds to nearest even, as the GPU's cvt.rn.bf16.f32 does.
    f32 = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return f32.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def make_interpreter_bf16_faithful(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teach triton's interpreter the two bf16 operations our kernels rely on.

    The interpreter stores bf16 as raw uint16 bits: it truncates fp32 -> bf16 casts
    (the GPU rounds to nearest even) and feeds the raw bits of bf16 operands to
    np.matmul in tl.dot (the GPU multiplies the values, accumulating in fp32).
    Kernels never do other arithmetic on bf16 values; they upcast first.
    """
    builder = interpreter.InterpreterBuilder
    plain_cast, plain_dot = builder.cast_impl, builder.create_dot

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_f32_to_bf16_bits(src.data), tl.bfloat16)
        return plain_cast(self, src, dst_type)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar == tl.bfloat16 or b.dtype.scalar == tl.bfloat16:
            a = interpreter.TensorHandle(_bf16_bits_to_f32(a.data), tl.float32)
            b = interpreter.TensorHandle(_bf16_bits_to_f32(b.data), tl.float32)
        return plain_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(builder, "cast_impl", cast_impl)
    monkeypatch.setattr(builder, "create_dot", create_dot)


# The interpreter's float8 conversions round half up and drop the carry into the exponent
# (-124.0 becomes -64.0); the GPU's cvt.rn rounds to nearest even, as torch does.
INTERPRETER_FLOATS = {
    tl.float32: torch.float32,
    tl.float16: torch.float16,
    tl.bfloat16: torch.bfloat16,
    tl.float8e4nv: torch.float8_e4m3fn,
}
TORCH_STORAGE = {
    torch.float32: torch.float32,
    torch.float16: torch.float16,
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
}


def make_interpreter_fp8_faithful(monkeypatch: pytest.MonkeyPatch) -> None:
    """Convert to and from float8 e4m3 through torch, whose conversions the GPU's match."""
    builder = interpreter.InterpreterBuilder
    plain_fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        src_tl, dst_tl = src.dtype.scalar, dst_type.scalar
        if tl.float8e4nv not in (src_tl, dst_tl):
            return plain_fp_to_fp(self, src, dst_type, rounding_mode)
        src_t, dst_t = INTERPRETER_FLOATS[src_tl], INTERPRETER_FLOATS[dst_tl]
        values = torch.from_numpy(np.ascontiguousarray(src.data)).view(src_t)
        data = values.to(dst_t).view(TORCH_STORAGE[dst_t]).numpy()
        if dst_t == torch.bfloat16:
            data = data.view(np.uint16)
        return interpreter.TensorHandle(data, dst_tl)

    monkeypatch.setattr(builder, "create_fp_to_fp", create_fp_to_fp)


def patch_the_language_once_per_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let a launch's patch of triton.language serve the @triton.jit helpers it calls.

    The interpreter swaps triton.language's builtins for interpreted ones at each launch (a scan
    of the language's modules with inspect.getmembers, undone when the launch ends), and again at
    each call of a jit helper inside it (InterpretedFunction.__call__), never undone there: the
    helper's scan finds the same modules already patched and sets the same functions again. A
    kernel calls its helpers once per tile of each program, so those scans were about a fifth of
    an interpreted test's time (tests/kernels/test_model_interpreter.py under cProfile: 10,703
    scans for 100 launches). A helper whose module sees a language module the launch did not
    patch still has it patched, as before.
    """
    plain_patch_lang = interpreter._patch_lang
    plain_launch = interpreter.GridExecutor.__call__
    patched: list[set] = []  # while a launch runs: the language modules its patches cover

    def patch_lang(fn):
        modules = {value for value in fn.__globals__.values() if inspect.ismodule(value) and value in (tl, tl.core)}
        if patched and modules <= patched[-1]:
            return interpreter._LangPatchScope()  # nothing to restore: the launch's scope restores it all
        if patched:
            patched[-1] |= modules
        return plain_patch_lang(fn)

    def launch(self, *args, **kwargs):
        patched.append(set())
        try:
            return plain_launch(self, *args, **kwargs)
        finally:
            patched.pop()

    monkeypatch.setattr(interpreter, "_patch_lang", patch_lang)
    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch)


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> str:
    """Where this test runs the kernels: compiled on CUDA, else interpreted on CPU."""
    if torch.cuda.is_available():
        return "cuda"
    kernel = importlib.import_module("kernels.rms_norm")._rms_norm_kernel
    if not isinstance(kernel, interpreter.InterpretedFunction):
        pytest.fail("triton or kernels/ was imported before tests/conftest.py could select interpreter mode")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    make_interpreter_bf16_faithful(monkeypatch)
    make_interpreter_fp8_faithful(monkeypatch)
    patch_the_language_once_per_launch(monkeypatch)
    return "cpu"


@pytest.fixture
def check_close(request: pytest.FixtureRequest):
    """check_close(kernel_name, actual, expected): the dtype's tolerance, and the max error logged."""
    errors = request.config.stash.setdefault(MAX_ERRORS, {})

    def check(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        key = (name, str(expected.dtype).removeprefix("torch."))
        error = (actual.float() - expected.float()).abs().max().item() if expected.numel() else 0.0
        errors[key] = max(errors.get(key, 0.0), error)
        torch.testing.assert_close(actual, expected, **TOLERANCES[expected.dtype])

    return check


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    errors = config.stash.get(MAX_ERRORS, None)
    if not errors:
        return
    terminalreporter.section("kernel max abs error vs reference")
    for (name, dtype), error in sorted(errors.items()):
        terminalreporter.write_line(f"{name:32s} {dtype:9s} {error:.3e}")
