"""The CPU engine's float32 norm and q/k norm + RoPE kernels (numba) against the torch references."""
import pytest
import torch

from kernels.cpu_norm_rope import fused_add_rms_norm_cpu, qk_norm_rope_cpu, rms_norm_cpu
from kernels.rms_norm import fused_add_rms_norm_reference, rms_norm_reference
from kernels.rope import qk_norm_rope_reference, rope_cos_sin_cache

SHAPES = pytest.mark.parametrize("tokens,hidden", [(1, 64), (7, 200), (300, 512)])
MAX_POSITION = 4096


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
    tokens = 9
    # q and k are views into one fused qkv row, as the model splits them.
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, seed=q_heads * head_dim) * 2
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    q_weight, k_weight = 1 + 0.1 * randn(head_dim, seed=1), 1 + 0.1 * randn(head_dim, seed=2)
    positions = torch.cat([torch.tensor([0, MAX_POSITION - 1]), torch.randint(0, MAX_POSITION, (tokens - 2,))])
    cos_sin = rope_cos_sin_cache(head_dim, MAX_POSITION, 1e6)
    before = qkv.clone()
    got = qk_norm_rope_cpu(q, k, q_weight, k_weight, positions, cos_sin, 1e-6)
    want = qk_norm_rope_reference(q, k, q_weight, k_weight, positions, cos_sin, 1e-6)
    check_close("qk_norm_rope_cpu", got[0], want[0])
    check_close("qk_norm_rope_cpu", got[1], want[1])
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_cpu_norms_pass_a_nonfinite_value_on_to_its_own_row_only(value):
    x, weight = torch.ones(3, 64), torch.ones(64)
    x[1, 7] = value
    for out in (rms_norm_cpu(x, weight, 1e-6), fused_add_rms_norm_cpu(x, torch.zeros(3, 64), weight, 1e-6)[0]):
        assert torch.isfinite(out[[0, 2]]).all() and not torch.isfinite(out[1]).all()
