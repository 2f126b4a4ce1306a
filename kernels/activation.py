"""SwiGLU gate on the fused gate/up projection."""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import use_triton


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, inter, BLOCK: tl.constexpr):
    # silu(gate) is rounded to the activation dtype before the product, as in the reference.
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + token * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + token * x_stride + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(act).to(tl.float32)
    tl.store(out_ptr + token * out_stride + cols, (silu * up).to(act), mask=mask)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    inter = x2.shape[1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0] == 0 or inter == 0:
        return out
    block = min(triton.next_power_of_2(inter), 1024)
    out2 = out.view(-1, inter)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2,
        out2,
        x2.stride(0),
        out2.stride(0),
        inter,
        BLOCK=block,
        num_warps=4,
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        return silu_and_mul_triton(x)
    return silu_and_mul_reference(x)
