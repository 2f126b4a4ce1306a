"""Which of a step's decodes get a draft, and how long: the speculator asks its proposer for up
to k tokens after each decoding request's last one, within what the request may still produce,
the step's token budget and the free KV pages."""

from __future__ import annotations

from worker.engine.grammar.draft_masks import DraftMasks
from worker.engine.outputs import RequestOutput
from worker.engine.request import Request
from worker.engine.sampler import PenaltyState
from worker.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from worker.engine.speculative.adaptive import AdaptiveSpeculation
from worker.engine.speculative.proposer import Proposer
from worker.engine.speculative.verify import Verification, settle


class Speculator:
    def __init__(self, proposer: Proposer, num_tokens: int, max_model_len: int, draft_masks: DraftMasks):
        self.proposer = proposer
        self.num_tokens = num_tokens  # k: the longest draft
        self.max_model_len = max_model_len
        self.draft_masks = draft_masks  # a request with a grammar keeps the draft its masks allow
        self.adaptive = AdaptiveSpeculation()  # whether a step speculates
        self.drafts = self.draft_tokens = self.accepted_tokens = 0  # verified so far (EngineStats)
        self._cut_by_room = False  # the step's drafts: one was cut short by its request's end

    def draft(self, scheduled: SchedulerOutput, scheduler: Scheduler) -> None:
        """Gives the step's decoding chunks their drafts (chunk.draft, chunk.num_tokens). Each
        request's pages are reserved first, so a proposer that runs a model writes its KV there."""
        chunks, limits = [], []
        budget = scheduled.budget
        self._cut_by_room = False
        for chunk in scheduled.chunks:
            if budget > 0 and self.may_draft(chunk):
                room = self.room(chunk.request)
                self._cut_by_room |= room < self.num_tokens
                n = scheduler.pages.reserve_draft(chunk.request, min(room, budget))
                if n > 0:
                    chunks.append(chunk)
                    limits.append(n)
                    budget -= n
        if not chunks:
            return
        for chunk, draft in zip(chunks, self.proposer.propose([c.request for c in chunks], limits)):
            if draft and chunk.request.grammar is not None:
                draft = draft[: self.draft_masks.allowed(chunk.request, draft)]
            chunk.draft = draft
            chunk.num_tokens += len(draft)
            scheduled.budget -= len(draft)

    @property
    def totals(self) -> tuple[int, int, int]:
        """(drafts, their tokens, the tokens accepted) verified so far."""
        return self.drafts, self.draft_tokens, self.accepted_tokens

    def settle(self, verification: Verification, penalties: PenaltyState, vocab_size: int) -> None:
        """After a verify step's tokens are read (speculative/verify.py), and counted."""
        settle(verification, penalties, vocab_size)
        self.drafts += verification.num_drafts
        self.draft_tokens += verification.num_draft_tokens
        self.accepted_tokens += verification.num_accepted

    def measure(
        self, batch: int, speculated: bool, chunks: list[ScheduledChunk], outputs: list[RequestOutput], seconds: float
    ) -> None:
        """A step's output tokens per second, for the adaptive choice: decode steps only, since a
        prefill chunk's cost says nothing about speculation, and not a speculating step where a
        request's draft was cut short by the end of its output: that says nothing of the next."""
        if speculated and self._cut_by_room:
            return
        if chunks and all(c.num_tokens - len(c.draft) == 1 and c.samples for c in chunks):
            self.adaptive.record(batch, speculated, sum(len(o.new_token_ids) for o in outputs), seconds)

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """The step the target just ran (an EAGLE-3 head drafts from its hidden states)."""
        self.proposer.observe(chunks)

    @staticmethod
    def may_draft(chunk: ScheduledChunk) -> bool:
        """A decode (its one token is its last) of a request that has not opted out."""
        req = chunk.request
        return chunk.samples and chunk.num_tokens == 1 and req.params.speculative and not req.token_in_flight

    def room(self, req: Request) -> int:
        """How many drafted tokens the request can still use: a step that accepts n of them also
        yields the token after them, and the output ends at max_tokens or max_model_len."""
        left = min(req.params.max_tokens - req.num_output_tokens, self.max_model_len - len(req.token_ids))
        return max(0, min(self.num_tokens, left - 1))
