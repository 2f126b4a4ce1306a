"""A verify step's rows: what each row samples for, and what is settled once the draws are read.

A request with a draft d_1..d_n gets rows 0..n. Row i samples the token that follows d_i (the
request's own last token for row 0) for the request as it would stand had its output gone on
with d_1..d_i: its min_tokens count, its penalties' token counts and its place in its random
stream are those of that request (`Lookahead`). The reader takes row i's draw only if rows
0..i-1 drew d_1..d_i, so every token taken was sampled from the very state it is read in.

A seeded request draws its rows' noise from its generator in order, as n + 1 decode steps would;
when fewer are taken, its generator goes back to where the tokens taken leave it (`settle`), so its
stream always stands at its output's length, as `skip_draws` assumes for a resumed job.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from worker.engine.request import Request
from worker.engine.sampler import PenaltyState, has_penalties, is_greedy, skip_draws
from worker.engine.scheduler import ScheduledChunk


class Lookahead:
    """`request` as the sampler would see it had `draft` been its next output tokens."""

    __slots__ = ("__weakref__", "draft", "request")

    def __init__(self, request: Request, draft: list[int]):
        self.request = request
        self.draft = draft

    @property
    def params(self):
        return self.request.params

    @property
    def generator(self) -> torch.Generator | None:
        return self.request.generator

    @property
    def grammar(self):
        return None  # its row's mask is the request's grammar after the draft (grammar/draft_masks.py)

    @property
    def is_finished(self) -> bool:
        return self.request.is_finished

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.draft)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.draft


@dataclass
class SeededRows:
    request: Request
    state: torch.Tensor  # its generator's state before the step's draws
    first_index: int  # where its first row's token goes in its token_ids
    num_rows: int  # the rows it drew noise for


@dataclass
class Verification:
    """What reading a verify step needs beyond the draws."""

    offsets: list[int]  # per row: i, the number of draft tokens it follows (0: the request's own first row)
    expected: list[int | None]  # per row: the draft token its draw must equal for the next row to count
    seeded: list[SeededRows] = field(default_factory=list)
    penalized: list[Request] = field(default_factory=list)
    num_drafts: int = 0  # requests with a draft
    num_draft_tokens: int = 0
    num_accepted: int = 0  # draft tokens the reader took


@dataclass
class SamplingRows:
    requests: list[Request]  # per row, the request it samples for
    views: list  # per row, what the sampler reads: the request, or a Lookahead of it
    verification: Verification | None


def sampling_rows(chunks: list[ScheduledChunk]) -> SamplingRows:
    """The step's rows of logits, in order: one per sampling chunk, n + 1 for a chunk with an n-token draft."""
    if not any(c.draft for c in chunks):
        requests = [c.request for c in chunks if c.samples]
        return SamplingRows(requests, requests, None)
    requests, views, verification = [], [], Verification([], [])
    for c in chunks:
        if not c.samples:
            continue
        req, draft = c.request, c.draft
        requests += [req] * (len(draft) + 1)
        views += [req] + [Lookahead(req, draft[:i]) for i in range(1, len(draft) + 1)]
        verification.offsets += range(len(draft) + 1)
        verification.expected += [*draft, None]
        if draft:
            note_draft(verification, req, len(draft))
    return SamplingRows(requests, views, verification)


def note_draft(verification: Verification, req: Request, num_tokens: int) -> None:
    verification.num_drafts += 1
    verification.num_draft_tokens += num_tokens
    if req.generator is not None and not is_greedy(req.params):
        verification.seeded.append(SeededRows(req, req.generator.get_state(), len(req.token_ids), num_tokens + 1))
    if has_penalties(req.params):
        verification.penalized.append(req)


def settle(verification: Verification, penalties: PenaltyState, vocab_size: int) -> None:
    """After the reader took the step's tokens: each seeded request's stream goes back to where
    its tokens taken leave it, and a penalized request's counts, which saw its first row's draw
    only, are rebuilt from its tokens when it next samples."""
    for rows in verification.seeded:
        req, taken = rows.request, len(rows.request.token_ids) - rows.first_index
        if req.is_finished or taken == rows.num_rows:
            continue
        req.generator.set_state(rows.state)
        skip_draws(req, taken, vocab_size)
    for req in verification.penalized:
        penalties.forget(req)
