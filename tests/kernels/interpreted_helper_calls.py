"""A kernel that calls a @triton.jit helper CALLS times, for tests/kernels/test_interpreter.py.
Imported by that test once the `device` fixture has chosen the interpreter (triton.jit decides
compiled-or-interpreted when a function is defined)."""

import triton
import triton.language as tl


@triton.jit
def add_one(x):
    return x + 1


@triton.jit
def add_calls_kernel(ptr, CALLS: tl.constexpr):
    offsets = tl.arange(0, 4)
    x = tl.load(ptr + offsets)
    for _ in tl.static_range(CALLS):
        x = add_one(x)
    tl.store(ptr + offsets, x)
