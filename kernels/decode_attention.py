"""Paged decode attention: one query token per request over its cached context."""
import torch


def gather_context(cache: torch.Tensor, page_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached rows of one request, [length, Hk, D]."""
    page_size = cache.shape[1]
    pages = page_row[: (length + page_size - 1) // page_size].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal_offset: int | None) -> torch.Tensor:
    """q [Lq, Hq, D] over k, v [Lk, Hk, D]; query i sees keys <= causal_offset + i. fp32 math."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = (qf @ kf.transpose(1, 2)) * scale
    if causal_offset is not None:
        qi = torch.arange(q.shape[0], device=q.device)[:, None]
        ki = torch.arange(k.shape[0], device=q.device)[None, :]
        scores.masked_fill_(ki > qi + causal_offset, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)


def paged_decode_attention_reference(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    page_table: torch.Tensor, context_lens: torch.Tensor, scale: float,
) -> torch.Tensor:
    """q [B, Hq, D]; page_table [B, max_pages] int32; context_lens [B] (includes the current token)."""
    out = torch.empty_like(q)
    for b, length in enumerate(context_lens.tolist()):
        k = gather_context(k_cache, page_table[b], length)
        v = gather_context(v_cache, page_table[b], length)
        out[b] = attend(q[b : b + 1], k, v, scale, causal_offset=None)[0]
    return out


def paged_decode_attention(q, k_cache, v_cache, page_table, context_lens, scale):
    return paged_decode_attention_reference(q, k_cache, v_cache, page_table, context_lens, scale)
