"""SwiGLU gate on the fused gate/up projection."""
import torch
import torch.nn.functional as F


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_reference(x)
