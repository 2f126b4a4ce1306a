"""Per-head q/k RMSNorm + neox RoPE against the torch reference."""

import pytest
import torch

from kernels.rope import qk_norm_rope_reference, qk_norm_rope_triton, rope_cos_sin_cache
from worker.model.rope import YarnScaling, rope_table

MAX_POSITION = 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_heads,kv_heads", [(2, 2), (4, 2), (12, 3), (16, 2)])
def test_qk_norm_rope_matches_reference(q_heads, kv_heads, head_dim, dtype, device, check_close):
    g = torch.Generator().manual_seed(q_heads * head_dim)
    tokens = 9
    # q and k are views into one fused qkv row, as the model splits them.
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype=dtype, device=device)
    q = qkv[:, : q_heads * head_dim].view(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    q_weight = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype=dtype, device=device)
    k_weight = (1 + 0.1 * torch.randn(head_dim, generator=g)).to(dtype=dtype, device=device)
    positions = torch.cat(
        [torch.tensor([0, MAX_POSITION - 1]), torch.randint(0, MAX_POSITION, (tokens - 2,), generator=g)]
    )
    positions = positions.to(device)
    cos_sin = rope_cos_sin_cache(head_dim, MAX_POSITION, 1e6, device=device)
    before = qkv.clone()
    got = qk_norm_rope_triton(q, k, q_weight, k_weight, positions, cos_sin, 1e-6)
    want = qk_norm_rope_reference(q, k, q_weight, k_weight, positions, cos_sin, 1e-6)
    check_close("qk_norm_rope", got[0], want[0])
    check_close("qk_norm_rope", got[1], want[1])
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_qk_norm_rope_reads_a_yarn_table_past_the_original_window(dtype, device, check_close):
    # Qwen3's YaRN (32,768 positions scaled 4x): positions from 40K to the last of 131,072.
    g = torch.Generator().manual_seed(5)
    q = torch.randn(6, 4, 128, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(6, 2, 128, generator=g).to(dtype=dtype, device=device)
    w = torch.ones(128, dtype=dtype, device=device)
    positions = torch.tensor([40000, 40001, 65535, 98304, 131070, 131071], device=device)
    yarn = YarnScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768)
    cos_sin = rope_table(128, 1e6, 131072, yarn, device=device)
    got = qk_norm_rope_triton(q, k, w, w, positions, cos_sin, 1e-6)
    want = qk_norm_rope_reference(q, k, w, w, positions, cos_sin, 1e-6)
    check_close("qk_norm_rope", got[0], want[0])
    check_close("qk_norm_rope", got[1], want[1])
