"""Storing K/V into the paged cache: the same bytes as the reference, skipped slots untouched."""
import pytest
import torch

from kernels.kv_store import store_kv_reference, store_kv_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_store_kv_writes_the_reference_slots_and_skips_minus_one(kv_heads, head_dim, page_size, dtype, device):
    g = torch.Generator().manual_seed(kv_heads * head_dim + page_size)
    tokens, num_pages = 12, 6
    qkv = torch.randn(tokens, 3 * kv_heads * head_dim, generator=g).to(dtype=dtype, device=device)
    k = qkv[:, kv_heads * head_dim : 2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, 2 * kv_heads * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(num_pages * page_size, generator=g)[:tokens]
    slots[[2, 7]] = -1
    slot_mapping = slots.to(device)
    shape = (num_pages, page_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    v_cache = torch.randn(shape, generator=g).to(dtype=dtype, device=device)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(k, v, want_k, want_v, slot_mapping)
    store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache, want_k)
    assert torch.equal(v_cache, want_v)
