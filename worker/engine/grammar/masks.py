"""The batch's token bitmasks: one row per constrained request, filled while the model runs.

Each request with a started grammar gets a row of a table (a slot, given back when it ends).
Filling a row asks its matcher which tokens may come next (llguidance writes the bits straight
into the row, without the GIL), then settles the tokens that end the request: EOS and the stop
ids are allowed where the grammar accepts the output as it is, and nowhere else (a stop id the
grammar allows elsewhere is drawn as an ordinary token there: the reader does not stop on it). A
request still thinking (before `</think>`) may draw any token but EOS.

When the engine reads a step's tokens the matchers advance, and the rows of the requests that
will sample again are filled at once on a thread of this module's own, while the loop goes on
(the worker publishes, the next step is scheduled and the model runs). The sampler's call waits
for that fill and fills, then and there, the rows it did not foresee (a request that just
finished its prefill, or whose grammar just started). One kernel launch then masks the batch's
logits (kernels/token_bitmask.py): on CPU it reads the table where it lies; for a GPU the rows
are gathered into pinned memory and copied behind the model's work, without a sync.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from kernels.token_bitmask import apply_token_bitmask, words_for
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
        self._free = list(range(rows - 1, -1, -1))
        self._thread: ThreadPoolExecutor | None = None
        self._pending: Future | None = None

    def prefill(self, requests: Sequence[Request]) -> None:
        """Starts filling, on the fill thread, the rows of the requests that will sample next."""
        self.settle()
        grammars = [r.grammar for r in requests if self._needs_row(r)]
        if not grammars:
            return
        for g in grammars:
            self._give_slot(g)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._pending = self._thread.submit(self._fill_all, grammars)

    def settle(self) -> None:
        """Waits for a fill in progress: matchers are touched by one thread at a time."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def batch_mask(self, requests: Sequence[Request]) -> BatchMask | None:
        """The rows of the batch `requests` (one per logits row) that are masked, every one filled
        for its matcher's present state; None when no request of the batch has a grammar."""
        self.settle()
        rows = [i for i, r in enumerate(requests) if self._needs_row(r)]
        if not rows:
            return None
        for i in rows:
            grammar = requests[i].grammar
            self._give_slot(grammar)
            if grammar.filled_at != grammar.position:
                self._fill(grammar)
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

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    @staticmethod
    def _needs_row(req: Request) -> bool:
        return req.grammar is not None and req.grammar.started and not req.is_finished

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
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _fill_all(self, grammars: list[RequestGrammar]) -> None:
        for g in grammars:
            self._fill(g)

    def _fill(self, grammar: RequestGrammar) -> None:
        row = self.table[grammar.slot]
        words = row.numpy().view(np.uint32)
        if grammar.active:
            grammar.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        else:
            words[:] = ALL_BITS
        self._set_bits(words, self.eos_token_ids, False)  # the grammar's end is the request's own end tokens
        if grammar.accepts_end:
            self._set_bits(words, grammar.end_token_ids, True)
        grammar.filled_at = grammar.position

    @staticmethod
    def _set_bits(words: np.ndarray, token_ids: Sequence[int], allowed: bool) -> None:
        for t in token_ids:
            bit = np.uint32(1 << (t & 31))
            if allowed:
                words[t >> 5] |= bit
            else:
                words[t >> 5] &= ~bit
