"""The CPU engine's float32 norm and q/k norm + RoPE kernels (numba) against the torch references."""
import pytest
import torch

from kernels.cpu_norm_rope import fused_add_rms_norm_cpu, qk_norm_rope_cpu, rms_norm_cpu
from kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_reference
from tests.kernels.test_rope import check_against_reference

SHAPES = pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 200), (300, 512)])


def randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@SHAPES
def test_cpu_rms_norm_matches_reference(tokens, hidden, check_close):
    x, weight = randn(tokens, hidden, seed=0) * 3, 1 + randn(hidden, seed=1) * 0.1
    check_close("rms_norm_cpu", rms_norm_cpu(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6))


@SHAPES
def test_cpu_fused_add_rms_norm_matches_reference(tokens, hidden, check_close):
    x, residual, weight = randn(tokens, hidden, seed=0), randn(tokens, hidden, seed=2) * 4, 1 + randn(hidden, seed=1) * 0.1
    got = fused_add_rms_norm_cpu(x, residual, weight, 1e-6)
    want = fused_add_rms_norm_reference(x, residual, weight, 1e-6)
    check_close("fused_add_rms_norm_cpu", got[0], want[0])
    assert torch.equal(got[1], want[1])  # the residual sum is one rounding either way


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (8, 4), (16, 2)])
def test_cpu_qk_norm_rope_matches_reference(q_heads, kv_heads, head_dim, check_close):
    check_against_reference(qk_norm_rope_cpu, "qk_norm_rope_cpu", q_heads, kv_heads, head_dim, torch.float32, "cpu", check_close)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_cpu_norms_pass_a_nonfinite_value_on_to_its_own_row_only(value):
    x, weight = torch.ones(3, 64), torch.ones(64)
    x[1, 7] = value
    for out in (rms_norm_cpu(x, weight, 1e-6), fused_add_rms_norm_cpu(x, torch.zeros(3, 64), weight, 1e-6)[0]):
        assert torch.isfinite(out[[0, 2]]).all() and not torch.isfinite(out[1]).all()
