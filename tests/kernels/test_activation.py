"""SiLU-and-mul against the torch reference."""

import pytest
import torch

from kernels.activation import silu_and_mul_reference, silu_and_mul_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("tokens,inter", [(1, 64), (7, 300), (3, 1100)])  # 1100 > one 1024-wide block
def test_silu_and_mul_matches_reference(tokens, inter, dtype, device, check_close):
    x = (torch.randn(tokens, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 3).to(
        dtype=dtype, device=device
    )
    check_close("silu_and_mul", silu_and_mul_triton(x), silu_and_mul_reference(x))


def test_silu_and_mul_reads_strided_rows(device, check_close):
    wide = torch.randn(5, 700, generator=torch.Generator().manual_seed(1)).to(device)
    x = wide[:, :600]
    check_close("silu_and_mul", silu_and_mul_triton(x), silu_and_mul_reference(x))
