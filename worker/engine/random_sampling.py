"""Random draws: temperature, then min_p -> top_k -> top_p (vLLM's order), then a draw.

A draw is the exponential race: the argmax of p / q over the kept tokens, with q ~ Exp(1)
drawn per token, picks each token with probability p. A seeded request fills its q from its
own generator, a whole vocabulary row per token, so its draws depend on its seed and its
logits only, whatever else shares the batch (and `skip_draws` can replay them).

Which tokens are kept is settled among each row's CANDIDATES most likely tokens (one top-k)
instead of a sort of the whole vocabulary: min_p and top_k keep a prefix of the tokens by
probability, and top_p the shortest prefix whose mass reaches p, so once a filter drops a
candidate it drops every token outside the candidates too, and the kept set, the
probabilities within it and so the draw are exactly those of the full sort. A row whose cut
falls past its candidates (a flat distribution under a top_p near 1, a top_k above
CANDIDATES) is settled by the full sort. Deciding which rows that is reads the device's
answer on the host, which costs nothing on CPU but would stall an overlapped CUDA step, so
on CUDA every row goes through the full sort (a sort-free cut there needs a kernel of its own,
as FlashInfer's rejection sampling).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker.engine.request import Request
from worker.engine.transfer import tensor_on

CANDIDATES = 256


@dataclass
class DrawParams:
    """The random rows' requests and their parameters, as [R, 1] tensors on the logits' device."""

    requests: list[Request]
    temperature: torch.Tensor
    min_p: torch.Tensor
    top_k: torch.Tensor  # 0: off
    top_p: torch.Tensor
    # What the rows use, known on the host: reading it from the tensors would be a sync.
    max_top_k: int  # the largest top_k (0: no row uses top_k)
    uses_min_p: bool
    uses_top_p: bool
    uses_top_p_alone: bool  # a row filters by top_p and nothing else
    seeded_rows: list[int]  # rows whose request draws from its own generator
    seeded_index: torch.Tensor  # the same rows on the device (a list as an index would wait for the device)

    @classmethod
    def of(cls, requests: list[Request], device: torch.device) -> DrawParams:
        params = [r.params for r in requests]
        seeded = [i for i, r in enumerate(requests) if r.generator is not None]
        return cls(
            requests,
            tensor_on([p.temperature for p in params], device)[:, None],
            tensor_on([p.min_p for p in params], device)[:, None],
            tensor_on([p.top_k for p in params], device, torch.long)[:, None],
            tensor_on([p.top_p for p in params], device)[:, None],
            max_top_k=max(p.top_k for p in params),
            uses_min_p=any(p.min_p > 0 for p in params),
            uses_top_p=any(p.top_p < 1 for p in params),
            uses_top_p_alone=any(p.top_p < 1 and p.min_p == 0 and p.top_k == 0 for p in params),
            seeded_rows=seeded,
            seeded_index=tensor_on(seeded, device, torch.long),
        )

    @property
    def filters(self) -> bool:
        return self.uses_min_p or self.max_top_k > 0 or self.uses_top_p


def sample_random(logits: torch.Tensor, params: DrawParams) -> torch.Tensor:
    """logits [R, V] of the rows of `params` -> [R] sampled token ids."""
    seeded_noise = draw_seeded_noise([params.requests[i] for i in params.seeded_rows], logits.shape[1], logits.device)
    if logits.device.type != "cpu" or not params.filters:
        return draw_from_full_rows(logits, params, seeded_noise)
    tokens, settled = draw_from_candidates(logits, params, seeded_noise, CANDIDATES)
    rest = [i for i, ok in enumerate(settled.tolist()) if not ok]
    if rest:
        unsettled = set(rest)
        rest_noise = seeded_noise[[n for n, row in enumerate(params.seeded_rows) if row in unsettled]]
        rest_params = DrawParams.of([params.requests[i] for i in rest], logits.device)
        tokens[rest] = draw_from_full_rows(logits[rest], rest_params, rest_noise)
    return tokens


def draw_seeded_noise(seeded: list[Request], vocab: int, device: torch.device) -> torch.Tensor:
    """[S, V]: each seeded request's q for this step, one vocabulary row from its generator."""
    noise = torch.empty(len(seeded), vocab, device=device)
    for row, req in zip(noise, seeded):
        row.exponential_(generator=req.generator)
    return noise


def draw_from_candidates(
    logits: torch.Tensor,
    params: DrawParams,
    seeded_noise: torch.Tensor,
    num_candidates: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([R] token ids, [R] bool settled): each row's draw among its `num_candidates` most
    likely tokens, valid where `settled`, that is where the filters cut inside them."""
    k = min(num_candidates, logits.shape[1])
    values, ids = logits.topk(k, dim=-1)  # most likely first; temperature does not change the order
    weights = ((values - values[:, :1]) / params.temperature).exp_()  # probabilities up to one factor per row
    keep = weights >= params.min_p  # the most likely token's weight is 1
    min_p_cuts = keep[:, -1:].logical_not()
    if params.max_top_k > 0:
        kth = values.gather(1, (params.top_k.clamp(1, k) - 1))
        by_top_k = (params.top_k == 0) | (values >= kth)  # ties with the k-th are kept
        keep &= by_top_k
        top_k_cuts = (params.top_k > 0) & (params.top_k <= k) & (values[:, -1:] < kth)
    else:
        top_k_cuts = torch.zeros_like(min_p_cuts)
    inside = min_p_cuts | top_k_cuts  # what min_p and top_k keep lies among the candidates
    kept = weights * keep
    mass_before = kept.cumsum(dim=-1) - kept
    total = kept.sum(dim=-1, keepdim=True)
    only_top_p = (params.min_p == 0) & (params.top_k == 0) & (params.top_p < 1)
    if params.uses_top_p_alone:  # such a row keeps a prefix of the whole row: the row's mass is the total
        total = torch.where(inside, total, row_weight(logits, values[:, :1], params.temperature))
    keep &= mass_before < params.top_p * total
    settled = inside | (only_top_p & (mass_before[:, -1:] >= params.top_p * total))
    q = torch.empty_like(weights).exponential_()
    if params.seeded_rows:
        q[params.seeded_index] = seeded_noise.gather(1, ids[params.seeded_index])
    picks = (weights * keep / q).argmax(dim=-1, keepdim=True)
    return ids.gather(1, picks).view(-1), settled.view(-1)


def row_weight(logits: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """[R, 1]: the sum over each whole row of the weights draw_from_candidates gives its candidates."""
    return logits.sub(top).div_(temperature).exp_().sum(dim=-1, keepdim=True)


def draw_from_full_rows(logits: torch.Tensor, params: DrawParams, seeded_noise: torch.Tensor) -> torch.Tensor:
    """[R] token ids: the filters applied over whole rows (top_p by a full sort), then the race."""
    logits = logits / params.temperature
    if params.uses_min_p:
        apply_min_p(logits, params.min_p)
    if params.max_top_k > 0:
        apply_top_k(logits, params.top_k, params.max_top_k)
    if params.uses_top_p:
        logits = apply_top_p(logits, params.top_p)
    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs).exponential_()
    if params.seeded_rows:
        q[params.seeded_index] = seeded_noise
    return (probs / q).argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drops tokens whose probability is under min_p [R, 1] times the most likely token's."""
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k(logits: torch.Tensor, k: torch.Tensor, max_k: int) -> None:
    """Keeps each row's k [R, 1] largest logits (ties with the k-th are kept; 0 keeps them all).
    `max_k` is k's largest value, given from the host: reading it from the device would be a sync."""
    top = logits.topk(min(max_k, logits.shape[1]), dim=-1).values
    kth = top.gather(1, k.clamp(1, top.shape[1]) - 1).masked_fill_(k == 0, float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keeps the smallest set of most likely tokens whose mass reaches p [R, 1] (always at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    sorted_logits.masked_fill_(mass_before >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
