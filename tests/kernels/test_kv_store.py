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


def fp8_store_case(kv_heads, head_dim, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    tokens, num_pages, page_size = 12, 6, 16
    k = (torch.randn(tokens, kv_heads, head_dim, generator=g) * 40).to(dtype=dtype, device=device)
    v = (torch.randn(tokens, kv_heads, head_dim, generator=g) * 3).to(dtype=dtype, device=device)
    slots = torch.randperm(num_pages * page_size, generator=g)[:tokens]
    slots[[2, 7]] = -1
    # One scale per kv head; not all powers of two, so the division's rounding is exercised too.
    k_scale = torch.tensor([2.0 ** -(i % 3) * (1 + 0.3 * (i % 2)) for i in range(kv_heads)]).to(device)
    v_scale = torch.tensor([2.0 ** -(i % 4) for i in range(kv_heads)]).to(device)
    shape = (num_pages, page_size, kv_heads, head_dim)
    caches = [torch.randn(shape, generator=g).to(torch.float8_e4m3fn).to(device) for _ in range(2)]
    return k, v, caches, slots.to(device), k_scale, v_scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_store_kv_fp8_writes_the_reference_bytes(kv_heads, head_dim, dtype, device):
    k, v, (k_cache, v_cache), slots, k_scale, v_scale = fp8_store_case(kv_heads, head_dim, dtype, device, kv_heads)
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 448.5, -0.0])  # past e4m3's range: clamped to +-448, not NaN
    want_k, want_v = k_cache.clone(), v_cache.clone()
    store_kv_reference(k, v, want_k, want_v, slots, k_scale, v_scale)
    store_kv_triton(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))
    stored = want_k.view(-1, kv_heads, head_dim)[slots[0]].float()[0, :4] * k_scale[0]
    assert stored.tolist() == [448 * k_scale[0].item(), -448 * k_scale[0].item(), 448 * k_scale[0].item(), 0.0]


def test_store_kv_fp8_keeps_a_nan(device):
    # A numerical fault upstream must still reach the logits, where the sampler catches it.
    k, v, (k_cache, v_cache), slots, k_scale, v_scale = fp8_store_case(2, 64, torch.float32, device, 0)
    k[0, 1, 3] = float("nan")
    store_kv_triton(k, v, k_cache, v_cache, slots, k_scale, v_scale)
    assert torch.isnan(k_cache.view(-1, 2, 64)[slots[0], 1, 3].float())


def test_store_kv_fp8_refuses_missing_scales(device):
    k, v, (k_cache, v_cache), slots, k_scale, _ = fp8_store_case(2, 64, torch.float32, device, 0)
    with pytest.raises(ValueError, match="v_scale"):
        store_kv_triton(k, v, k_cache, v_cache, slots, k_scale, None)
