"""The batch's token bitmasks: one row per constrained request, filled while the model runs.

Each request with a started grammar gets a row of a table (a slot, given back when it ends).
Filling a row asks its matcher which tokens may come next (llguidance writes the bits straight
into the row, without the GIL), then settles the tokens that end the request: EOS and the stop
ids are allowed where the grammar accepts the output as it is, and nowhere else (a stop id the
grammar allows elsewhere is drawn as an ordinary token there: the reader does not stop on it). A
request still thinking (before `</think>`) may draw any token but EOS; one whose first token
decides whether it thinks may draw `<think>` or what the grammar allows but `</think>`.

When the engine has read a step's tokens, a thread of this module's own has each constrained
request's matcher consume its token and fills its row for the next step, while the loop goes on
(the worker publishes, the next step is scheduled and the model runs). The sampler's call waits
for that thread and fills, then and there, the rows it did not foresee (a request that just
finished its prefill, or whose grammar just started). A request whose grammar ended (complete, or
failed) gets no mask: the reader ends it without the token drawn for it. One kernel launch then masks the batch's
logits (kernels/token_bitmask.py): on CPU it reads the table where it lies; for a GPU the rows
are gathered into pinned memory and copied behind the model's work, without a sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import numpy as np
import torch

from kernels.token_bitmask import apply_token_bitmask, words_for
from worker.engine.grammar.constraint import Phase
from worker.engine.grammar.request_grammar import RequestGrammar
from worker.engine.request import Request
from worker.engine.transfer import tensor_on

ALL_BITS = np.uint32(0xFFFFFFFF)


@dataclass
class BatchMask:
    """Which logits rows are masked, by which table rows."""

    logit_rows: list[int]
    slots: list[int]


class GrammarMasks:
    def __init__(self, vocab_size: int, eos_token_ids: Sequence[int], rows: int):
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.table = torch.full((rows, words_for(vocab_size)), -1, dtype=torch.int32)
        self._words = self.table.numpy().view(np.uint32)  # the same memory, for bit edits
        self._row_bytes = self.table.shape[1] * self.table.element_size()
        self._free = list(range(rows - 1, -1, -1))
        self._thread: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._llguidance_threads = None  # llguidance.LLExecutor: its own pool, 80% of the cores (up to 32)

    def prefill(self, requests: Sequence[Request]) -> None:
        """Starts advancing the requests' matchers past the tokens just read, and filling their
        rows for the next step, on the mask thread."""
        self.settle()
        # A request that verified a draft has a row per token: its grammar is filled once.
        grammars = list(
            dict.fromkeys(
                r.grammar for r in requests if r.grammar is not None and r.grammar.started and not r.is_finished
            )
        )
        if not grammars:
            return
        for g in grammars:
            self._give_slot(g)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending = self._thread.submit(self._advance_and_fill, grammars)

    def settle(self) -> None:
        """Waits for a fill in progress: matchers are touched by one thread at a time."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def batch_mask(self, requests: Sequence[Request]) -> BatchMask | None:
        """The rows of the batch `requests` (one per logits row) that are masked, every one filled
        for its matcher's present state; None when no request of the batch has a grammar."""
        self.settle()
        rows, stale = [], []
        for i, req in enumerate(requests):
            grammar = req.grammar
            if grammar is None or not grammar.started or req.is_finished:
                continue
            grammar.advance()
            if grammar.ended:
                continue
            self._give_slot(grammar)
            if grammar.filled_at != grammar.position:
                stale.append(grammar)
            rows.append(i)
        if not rows:
            return None
        self._fill(stale)
        return BatchMask(rows, [requests[i].grammar.slot for i in rows])

    def apply(self, logits: torch.Tensor, mask: BatchMask) -> None:
        """Masks the logits in place: one kernel launch for the batch."""
        device = logits.device
        logit_rows = tensor_on(mask.logit_rows, device, torch.long)
        slots = torch.tensor(mask.slots, dtype=torch.long)
        if device.type == "cpu":
            apply_token_bitmask(logits, self.table, logit_rows, slots)
            return
        staged = torch.empty((len(mask.slots), self.table.shape[1]), dtype=torch.int32, pin_memory=True)
        torch.index_select(self.table, 0, slots, out=staged)
        rows = staged.to(device, non_blocking=True)
        apply_token_bitmask(logits, rows, logit_rows, torch.arange(len(mask.slots), device=device))

    def spare_slot(self) -> int:
        """A row of the table for a caller's own fill, given back with `return_slot`."""
        if not self._free:
            self._grow()
        return self._free.pop()

    def return_slot(self, slot: int) -> None:
        self._free.append(slot)

    def allows(self, slot: int, token: int) -> bool:
        """Whether the row at `slot` allows `token`."""
        return bool((int(self._words[slot][token >> 5]) >> (token & 31)) & 1)

    def fill(self, grammars: list[RequestGrammar]) -> None:
        """Fills the grammars' rows for their matchers' present state, on the caller's thread."""
        self._fill(grammars)

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def _give_slot(self, grammar: RequestGrammar) -> None:
        if grammar.slot is not None:
            return
        if not self._free:
            self._grow()
        slot = self._free.pop()
        grammar.slot, grammar.filled_at = slot, -1
        grammar.release_slot = lambda: self._free.append(slot)

    def _grow(self) -> None:
        """Doubles the table: more requests hold rows than it was sized for (a preempted request
        keeps its row while it waits, and Engine.generate may add more than max_running)."""
        old = self.table.shape[0]
        grown = torch.full((2 * old, self.table.shape[1]), -1, dtype=torch.int32)
        grown[:old] = self.table
        self.table = grown
        self._words = grown.numpy().view(np.uint32)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _advance_and_fill(self, grammars: list[RequestGrammar]) -> None:
        for g in grammars:
            g.advance()
        self._fill([g for g in grammars if not g.ended])

    def _fill(self, grammars: list[RequestGrammar]) -> None:
        """Fills the grammars' rows. llguidance computes the rows of the grammars past their
        thinking in one call, without the GIL, on its own threads (a row inside a string of bounded
        length walks the whole vocabulary: a quarter of a millisecond); then the few rows that need
        it are edited. llguidance sets EOS where the grammar accepts, which is where the request's
        own end tokens take its place."""
        answering = [g for g in grammars if g.phase is not Phase.THINKING]
        if answering:
            self._executor().unsafe_compute_mask_ptr(
                [(g.matcher, g.slot) for g in answering],
                self.table.data_ptr(),
                self._row_bytes,
                self.table.shape[0],
            )
        for g in grammars:
            if g.phase is Phase.THINKING:
                words = self._words[g.slot]
                words[:] = ALL_BITS
                self._set_bits(words, self.eos_token_ids, False)
            else:
                self._settle_row(g)
            g.filled_at = g.position

    def _settle_row(self, grammar: RequestGrammar) -> None:
        if grammar.matcher.is_error():  # no token is allowed: a contradiction the compile did not see
            grammar.error = grammar.matcher.get_error()
        if grammar.phase is Phase.DECIDING:
            # The grammar lets a reply start with `</think>`, for a reasoning this one has not opened.
            thinking = grammar.constraint.thinking
            self._set_bits(self._words[grammar.slot], (thinking.opens,), True)
            self._set_bits(self._words[grammar.slot], (thinking.closes,), False)
        if grammar.accepts_end:
            words = self._words[grammar.slot]
            self._set_bits(words, self.eos_token_ids, False)
            self._set_bits(words, grammar.end_token_ids, True)

    def _executor(self):
        if self._llguidance_threads is None:
            self._llguidance_threads = llguidance.LLExecutor()
        return self._llguidance_threads

    @staticmethod
    def _set_bits(words: np.ndarray, token_ids: Sequence[int], allowed: bool) -> None:
        for t in token_ids:
            bit = np.uint32(1 << (t & 31))
            if allowed:
                words[t >> 5] |= bit
            else:
                words[t >> 5] &= ~bit
