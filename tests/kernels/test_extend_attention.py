"""Paged extend attention (cached prefix + causal new tokens, varlen, GQA) against the torch reference."""

import pytest
import torch

import kernels.extend_attention as extend_attention
from kernels.extend_attention import paged_extend_attention_reference, paged_extend_attention_triton
from tests.kernels.paged import as_fp8_caches, random_caches, scattered_page_table

KV_HEADS = 2


def extend_case(group, head_dim, page_size, dtype, device, requests, seed=0):
    """requests: (prefix_len, q_len) pairs; the new tokens' K/V are already in the cache."""
    g = torch.Generator().manual_seed(seed)
    lengths = [prefix + q_len for prefix, q_len in requests]
    num_pages = sum(-(-n // page_size) for n in lengths) + 4
    k_cache, v_cache = random_caches(num_pages, page_size, KV_HEADS, head_dim, dtype, device, g)
    page_table = scattered_page_table(lengths, page_size, num_pages, device, g)
    q_lens = [q_len for _, q_len in requests]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    prefix_lens = torch.tensor([prefix for prefix, _ in requests], dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), KV_HEADS * group, head_dim, generator=g).to(dtype=dtype, device=device)
    return q, k_cache, v_cache, page_table, cu, prefix_lens, max(q_lens)


def run_both(case):
    q, k_cache, v_cache, page_table, cu, prefix_lens, max_q_len = case
    scale = q.shape[-1] ** -0.5
    got = paged_extend_attention_triton(q, k_cache, v_cache, page_table, cu, prefix_lens, scale, max_q_len)
    want = paged_extend_attention_reference(q, k_cache, v_cache, page_table, cu, prefix_lens, scale, max_q_len)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_extend_matches_reference_over_ragged_prefixes(group, head_dim, page_size, dtype, device, check_close):
    requests = [
        (0, 1),  # a fresh one-token prompt
        (0, page_size),  # exactly a page, no prefix
        (page_size, 1),  # a decode inside a mixed step: a page plus one
        (3 * page_size + 5, page_size + 1),  # a chunk after a many-page prefix, crossing pages
        (7, 70),  # unaligned prefix, causal band over several key tiles
    ]
    got, want = run_both(extend_case(group, head_dim, page_size, dtype, device, requests))
    check_close("paged_extend_attention", got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extend_long_prompt_spans_several_query_tiles(dtype, device, check_close):
    # More new tokens than one query tile holds, after a prefix longer than a key tile:
    # later tiles take the unmasked path over the prefix and their own causal band.
    got, want = run_both(extend_case(1, 64, 16, dtype, device, [(80, 150), (0, 140)], seed=2))
    check_close("paged_extend_attention", got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("group", [1, 4])
def test_extend_over_a_float8_cache_matches_reference(group, dtype, device, check_close):
    q, k_cache, v_cache, page_table, cu, prefix_lens, max_q_len = extend_case(
        group, 64, 16, dtype, device, [(0, 1), (16, 1), (53, 17), (7, 70)], seed=3
    )
    k8, v8, k_scale, v_scale = as_fp8_caches(k_cache, v_cache)
    scale = 64**-0.5
    args = (q, k8, v8, page_table, cu, prefix_lens, scale, max_q_len, k_scale, v_scale)
    check_close("paged_extend_attention", paged_extend_attention_triton(*args), paged_extend_attention_reference(*args))


def test_extend_reference_bounds_its_mask_without_changing_the_result(monkeypatch, device):
    # Query blocks of one row each: the block-causal slicing must give what one block gives.
    case = extend_case(2, 64, 16, torch.float32, device, [(0, 9), (21, 13)], seed=4)
    q, k_cache, v_cache, page_table, cu, prefix_lens, max_q_len = case
    whole = paged_extend_attention_reference(q, k_cache, v_cache, page_table, cu, prefix_lens, 0.125, max_q_len)
    monkeypatch.setattr(extend_attention, "MASK_ELEMENTS", 1)
    rows = paged_extend_attention_reference(q, k_cache, v_cache, page_table, cu, prefix_lens, 0.125, max_q_len)
    torch.testing.assert_close(rows, whole, atol=1e-6, rtol=1e-6)
