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


def plain_causal_attention(q, k, v, scale, prefix):
    """The definition, in float64 with every score materialized: softmax over keys [0, prefix + i]."""
    group = q.shape[1] // k.shape[1]
    keys, values = (t.double().repeat_interleave(group, 1).transpose(0, 1) for t in (k, v))  # [Hq, L, D]
    scores = q.double().transpose(0, 1) @ keys.transpose(1, 2) * scale  # [Hq, Lq, L]
    seen = torch.arange(k.shape[0]) <= prefix + torch.arange(q.shape[0])[:, None]
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
    return (weights @ values).transpose(0, 1)


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("prefix, q_len", [(0, 1), (0, 37), (1, 1), (45, 1), (45, 70), (300, 129), (16, 0)])
def test_the_cpu_reference_merging_prefix_and_causal_parts_is_plain_attention(group, prefix, q_len):
    # The CPU path attends the prefix unmasked and the new tokens causally, then merges the two by
    # their log-sum-exps; the masked blocks (off the CPU) attend the whole at once.
    g = torch.Generator().manual_seed(prefix + q_len + group)
    q = torch.randn(q_len, KV_HEADS * group, 64, generator=g)
    k, v = (torch.randn(prefix + q_len, KV_HEADS, 64, generator=g) for _ in range(2))
    want = plain_causal_attention(q, k, v, 0.125, prefix).float()
    torch.testing.assert_close(
        extend_attention.causal_attention_cpu(q, k, v, 0.125, prefix), want, atol=1e-6, rtol=1e-5
    )
    got = extend_attention.causal_attention_in_blocks(q, k, v, 0.125, prefix)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_the_masked_blocks_bound_their_mask_without_changing_the_result(monkeypatch, device):
    # Query blocks of one row each (off the CPU the reference's path, called here on any device): the
    # block-causal slicing must give what one block gives.
    g = torch.Generator().manual_seed(4)
    q = torch.randn(13, KV_HEADS * 2, 64, generator=g).to(device)
    k, v = (torch.randn(21 + 13, KV_HEADS, 64, generator=g).to(device) for _ in range(2))
    whole = extend_attention.causal_attention_in_blocks(q, k, v, 0.125, 21)
    monkeypatch.setattr(extend_attention, "MASK_ELEMENTS", 1)
    rows = extend_attention.causal_attention_in_blocks(q, k, v, 0.125, 21)
    torch.testing.assert_close(rows, whole, atol=1e-6, rtol=1e-6)
