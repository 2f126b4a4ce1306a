"""Paged extend (prefill) attention: new tokens over their cached prefix plus each other, causally."""
import torch

from kernels.decode_attention import attend, gather_context


def paged_extend_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, cu_seqlens_q: torch.Tensor, prefix_lens: torch.Tensor,
    scale: float, max_q_len: int,
) -> torch.Tensor:
    """q [T, Hq, D] for the new tokens of B requests (cu_seqlens_q [B+1]).

    The new tokens' K/V are already stored in the cache, so request b's keys are
    cache rows [0, prefix_lens[b] + q_len_b) read through page_table[b].
    """
    out = torch.empty_like(q)
    starts, prefixes = cu_seqlens_q.tolist(), prefix_lens.tolist()
    for b, prefix in enumerate(prefixes):
        lo, hi = starts[b], starts[b + 1]
        k = gather_context(k_cache, page_table[b], prefix + hi - lo)
        v = gather_context(v_cache, page_table[b], prefix + hi - lo)
        out[lo:hi] = attend(q[lo:hi], k, v, scale, causal_offset=prefix)
    return out


def paged_extend_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, prefix_lens, scale, max_q_len):
    return paged_extend_attention_reference(
        q, k_cache, v_cache, page_table, cu_seqlens_q, prefix_lens, scale, max_q_len
    )
