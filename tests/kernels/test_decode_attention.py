"""Paged decode attention (split-KV, GQA) against the torch reference."""

import pytest
import torch

from kernels.decode_attention import paged_decode_attention_reference, paged_decode_attention_triton
from tests.kernels.paged import as_fp8_caches, random_caches, scattered_page_table

KV_HEADS = 2


def decode_case(group, head_dim, page_size, dtype, device, contexts, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // page_size) for n in contexts) + 4
    k_cache, v_cache = random_caches(num_pages, page_size, KV_HEADS, head_dim, dtype, device, g)
    page_table = scattered_page_table(contexts, page_size, num_pages, device, g)
    q = torch.randn(len(contexts), KV_HEADS * group, head_dim, generator=g).to(dtype=dtype, device=device)
    context_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, page_table, context_lens


def run_both(case, num_splits=None):
    q, k_cache, v_cache, page_table, context_lens = case
    scale = q.shape[-1] ** -0.5
    got = paged_decode_attention_triton(q, k_cache, v_cache, page_table, context_lens, scale, num_splits=num_splits)
    want = paged_decode_attention_reference(q, k_cache, v_cache, page_table, context_lens, scale)
    return got, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_matches_reference_over_ragged_contexts(group, head_dim, page_size, dtype, device, check_close):
    # One token, exactly a page, a page plus one, and many pages (tiles span pages) in one batch.
    contexts = [1, page_size, page_size + 1, 5 * page_size + 3]
    got, want = run_both(decode_case(group, head_dim, page_size, dtype, device, contexts))
    check_close("paged_decode_attention", got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 2, 7])
def test_decode_split_count_does_not_change_the_result(num_splits, dtype, device, check_close):
    # 7 splits leave the short contexts' later splits empty; the merge must weigh them 0.
    contexts = [3, 64, 200, 129]
    got, want = run_both(decode_case(4, 128, 16, dtype, device, contexts, seed=1), num_splits=num_splits)
    check_close("paged_decode_attention", got, want)


def test_decode_of_an_empty_context_is_zero(device):
    # What the reference gives (softmax over no keys); a padded batch slot must not produce NaN.
    q, k_cache, v_cache, page_table, _ = decode_case(2, 64, 16, torch.float32, device, [5, 40])
    context_lens = torch.tensor([0, 40], dtype=torch.int32, device=device)
    scale = 64**-0.5
    got = paged_decode_attention_triton(q, k_cache, v_cache, page_table, context_lens, scale)
    want = paged_decode_attention_reference(q, k_cache, v_cache, page_table, context_lens, scale)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_over_a_float8_cache_matches_reference(group, head_dim, dtype, device, check_close):
    q, k_cache, v_cache, page_table, context_lens = decode_case(group, head_dim, 16, dtype, device, [1, 16, 17, 83])
    k8, v8, k_scale, v_scale = as_fp8_caches(k_cache, v_cache)
    scale = head_dim**-0.5
    got = paged_decode_attention_triton(q, k8, v8, page_table, context_lens, scale, k_scale, v_scale, num_splits=2)
    want = paged_decode_attention_reference(q, k8, v8, page_table, context_lens, scale, k_scale, v_scale)
    check_close("paged_decode_attention", got, want)


def test_decode_reference_over_a_float8_cache_attends_to_its_dequantized_values(device):
    # The float8 path is the plain one over scale * stored value: nothing else changes.
    q, k_cache, v_cache, page_table, context_lens = decode_case(2, 64, 16, torch.float32, device, [5, 40])
    k8, v8, k_scale, v_scale = as_fp8_caches(k_cache, v_cache)
    scale = 64**-0.5
    got = paged_decode_attention_reference(q, k8, v8, page_table, context_lens, scale, k_scale, v_scale)
    k32, v32 = k8.float() * k_scale[:, None], v8.float() * v_scale[:, None]
    want = paged_decode_attention_reference(q, k32, v32, page_table, context_lens, scale)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
