"""The CPU engine's float32 decode attention (numba) against the torch reference."""

import pytest
import torch

import kernels.cpu_decode_attention as cpu_decode_attention
from kernels.cpu_decode_attention import paged_decode_attention_cpu
from kernels.decode_attention import paged_decode_attention_reference
from tests.kernels.test_decode_attention import decode_case


def run_both(case):
    q, k_cache, v_cache, page_table, context_lens = case
    scale = q.shape[-1] ** -0.5
    got = paged_decode_attention_cpu(q, k_cache, v_cache, page_table, context_lens, scale)
    want = paged_decode_attention_reference(q, k_cache, v_cache, page_table, context_lens, scale)
    return got, want


@pytest.mark.parametrize("page_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_cpu_decode_matches_reference_over_ragged_contexts(group, head_dim, page_size, check_close):
    contexts = [1, page_size, page_size + 1, 5 * page_size + 3, 40 * page_size - 1]
    got, want = run_both(decode_case(group, head_dim, page_size, torch.float32, "cpu", contexts))
    check_close("paged_decode_attention_cpu", got, want)


def test_cpu_decode_reads_int64_context_lengths_and_a_strided_query(check_close):
    q, k_cache, v_cache, page_table, context_lens = decode_case(2, 64, 16, torch.float32, "cpu", [7, 100])
    strided_q = torch.cat([q, q], dim=-1)[..., :64]  # the shape of q, not its layout
    got, want = run_both((strided_q, k_cache, v_cache, page_table, context_lens.long()))
    check_close("paged_decode_attention_cpu", got, want)


def test_cpu_decode_of_an_empty_context_is_zero():
    q, k_cache, v_cache, page_table, _ = decode_case(2, 64, 16, torch.float32, "cpu", [5, 40])
    context_lens = torch.tensor([0, 40], dtype=torch.int32)
    got, want = run_both((q, k_cache, v_cache, page_table, context_lens))
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_cpu_decode_passes_a_nonfinite_value_on_to_its_own_request_only(value):
    # The sampler's non-finite check relies on a fault upstream reaching the logits.
    q, k_cache, v_cache, page_table, context_lens = decode_case(2, 64, 16, torch.float32, "cpu", [30, 30])
    k_cache[page_table[0, 1], 3, 0, 5] = value
    got, _ = run_both((q, k_cache, v_cache, page_table, context_lens))
    assert not torch.isfinite(got[0]).all()
    assert torch.isfinite(got[1]).all()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4])
def test_cpu_decode_reads_a_float8_cache_like_the_reference(group, head_dim, check_close):
    q, k_cache, v_cache, page_table, context_lens = decode_case(
        group, head_dim, 16, torch.float32, "cpu", [1, 16, 17, 83, 639]
    )
    k8, v8 = (k_cache * 4).to(torch.float8_e4m3fn), (v_cache * 2).to(torch.float8_e4m3fn)
    k_scale, v_scale = torch.tensor([0.25, 0.5]), torch.tensor([0.5, 2.0])  # one per kv head, unequal
    scale = head_dim**-0.5
    got = paged_decode_attention_cpu(q, k8, v8, page_table, context_lens, scale, k_scale, v_scale)
    want = paged_decode_attention_reference(q, k8, v8, page_table, context_lens, scale, k_scale, v_scale)
    check_close("paged_decode_attention_cpu", got, want)


@pytest.mark.parametrize("split", [24, 64])
def test_cpu_decode_cut_into_pieces_merges_to_the_reference(split, monkeypatch, check_close):
    # Pieces that start mid-page, a context of exactly one piece, one a token past it, one of many.
    monkeypatch.setattr(cpu_decode_attention, "SPLIT_TOKENS", split)
    contexts = [1, split, split + 1, 7 * split + 5, 0]
    got, want = run_both(decode_case(4, 64, 16, torch.float32, "cpu", contexts, seed=2))
    check_close("paged_decode_attention_cpu", got, want)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))


def test_cpu_decode_cut_into_pieces_keeps_a_nonfinite_value(monkeypatch):
    monkeypatch.setattr(cpu_decode_attention, "SPLIT_TOKENS", 16)
    q, k_cache, v_cache, page_table, context_lens = decode_case(2, 64, 16, torch.float32, "cpu", [100, 100])
    v_cache[page_table[0, 3], 3, 0, 5] = float("nan")
    got, _ = run_both((q, k_cache, v_cache, page_table, context_lens))
    assert not torch.isfinite(got[0]).all()
    assert torch.isfinite(got[1]).all()
