"""RMSNorm, and its fused residual-add variant."""

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    new_residual = x + residual
    return rms_norm_reference(new_residual, weight, eps), new_residual


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    x_stride,
    residual_stride,
    out_stride,
    residual_out_stride,
    hidden,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One row per program. Rounding follows the reference step by step: the residual
    # sum in the activation dtype, the norm in fp32, the normed row cast back to the
    # activation dtype before the weight multiplies it (as transformers' Qwen3RMSNorm).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    act = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        res = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0)
        act = (act.to(tl.float32) + res.to(tl.float32)).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, act, mask=mask)
    xf = act.to(tl.float32)
    # Correctly rounded sqrt and divide, as torch.rsqrt on CPU computes 1 / sqrt.
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, axis=0) / hidden + eps))
    normed = (xf * rstd).to(act.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as a [rows, hidden] view whose last dim is contiguous (a copy only when it must)."""
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch_rms_norm(x, residual, weight, eps, out, residual_out):
    hidden = x.shape[-1]
    x2, out2 = _rows(x), out.view(-1, hidden)
    res2 = _rows(residual) if residual is not None else x2
    res_out2 = residual_out.view(-1, hidden) if residual_out is not None else out2
    if x2.shape[0] == 0:
        return
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res2,
        weight,
        out2,
        res_out2,
        x2.stride(0),
        res2.stride(0),
        out2.stride(0),
        res_out2.stride(0),
        hidden,
        eps,
        ADD_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch_rms_norm(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    act_dtype = torch.promote_types(x.dtype, residual.dtype)
    residual_out = torch.empty(x.shape, dtype=act_dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(act_dtype, weight.dtype), device=x.device)
    _launch_rms_norm(x, residual, weight, eps, out, residual_out)
    return out, residual_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(x):
        return fused_add_rms_norm_triton(x, residual, weight, eps)
    return fused_add_rms_norm_reference(x, residual, weight, eps)
