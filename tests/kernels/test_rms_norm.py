"""RMSNorm and fused residual-add RMSNorm against the torch reference."""

import pytest
import torch

from kernels.rms_norm import (
    fused_add_rms_norm_reference,
    fused_add_rms_norm_triton,
    rms_norm_reference,
    rms_norm_triton,
)

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
SHAPES = pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 200), (5, 1024)])


def randn(*shape, dtype, device, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype=dtype, device=device)


@DTYPES
@SHAPES
def test_rms_norm_matches_reference(tokens, hidden, dtype, device, check_close):
    x = randn(tokens, hidden, dtype=dtype, device=device, seed=0) * 3
    weight = 1 + randn(hidden, dtype=dtype, device=device, seed=1) * 0.1
    check_close("rms_norm", rms_norm_triton(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


@DTYPES
@SHAPES
def test_fused_add_rms_norm_matches_reference(tokens, hidden, dtype, device, check_close):
    x = randn(tokens, hidden, dtype=dtype, device=device, seed=0)
    residual = randn(tokens, hidden, dtype=dtype, device=device, seed=2) * 4
    weight = 1 + randn(hidden, dtype=dtype, device=device, seed=1) * 0.1
    normed, summed = fused_add_rms_norm_triton(x, residual, weight, 1e-5)
    want_normed, want_summed = fused_add_rms_norm_reference(x, residual, weight, 1e-5)
    # The residual sum is one rounding of an exact sum in both: equal to the bit.
    assert torch.equal(summed, want_summed)
    check_close("fused_add_rms_norm", normed, want_normed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rms_norm_reads_strided_rows_and_leaves_inputs_alone(dtype, device, check_close):
    wide = randn(6, 300, dtype=dtype, device=device, seed=3)
    x, residual = wide[:, :128], wide[:, 128:256]  # row stride 300, as slices of a fused projection
    before = wide.clone()
    weight = randn(128, dtype=dtype, device=device, seed=4)
    check_close("rms_norm", rms_norm_triton(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    normed, summed = fused_add_rms_norm_triton(x, residual, weight, 1e-6)
    want_normed, want_summed = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    assert torch.equal(summed, want_summed)
    check_close("fused_add_rms_norm", normed, want_normed)
    assert torch.equal(wide, before)


def test_rms_norm_keeps_leading_dims_and_empty_batches(device):
    x = randn(2, 3, 64, dtype=torch.float32, device=device, seed=5)
    weight = randn(64, dtype=torch.float32, device=device, seed=6)
    torch.testing.assert_close(rms_norm_triton(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))
    assert rms_norm_triton(x[:0, 0], weight, 1e-6).shape == (0, 64)
