"""Structured outputs under speculative decoding: the mask at every verified position.

A verify step's row i samples the token after a request's draft tokens d_1..d_i, so its mask is
the grammar's after those tokens: what the engine without speculation would mask there had the
request produced them. Before the model runs, `allowed` walks a copy of the request's grammar
state through the draft (its matcher takes the tokens, and gives them back after), fills a spare
row of the mask table for each position and keeps the draft only as far as each token is allowed
by the mask before it: a token the mask refuses could never be the target's draw, so nothing
after it could count. Where the grammar ends within the draft (its output is whole) the draft
ends too, and the row after it has no mask, as a step after the end would have none: the reader
ends the request there without that row's token.
"""

from __future__ import annotations

import copy

from worker.engine.grammar.masks import BatchMask, GrammarMasks
from worker.engine.request import Request
from worker.engine.speculative.verify import Lookahead


class DraftMasks:
    def __init__(self, masks: GrammarMasks):
        self.masks = masks
        self._rows: dict[Request, list[int | None]] = {}  # table rows of verify rows 1..n (None: no mask)

    def allowed(self, req: Request, draft: list[int]) -> int:
        """How many leading tokens of `draft` the request's grammar allows; fills their rows' masks."""
        masks, grammar = self.masks, req.grammar
        masks.settle()
        if masks.batch_mask([req]) is None:  # its grammar has ended: its next token ends it
            return 0
        look = copy.copy(grammar)  # its own phase and position; the matcher is shared
        slot, rows, consumed = grammar.slot, [], 0
        try:
            for token in draft:
                if not masks.allows(slot, token):
                    break
                look.take(token)
                answers = look.pending is not None
                look.advance()
                consumed += answers and look.error is None
                if look.ended:
                    rows.append(None)
                    break
                slot = look.slot = masks.spare_slot()
                masks.fill([look])
                rows.append(slot)
        finally:
            grammar.matcher.rollback(consumed)
        self._rows[req] = rows
        return len(rows)

    def add_rows(self, batch_mask: BatchMask | None, views: list) -> BatchMask | None:
        """`batch_mask` (the rows of the requests' own state) with the verify rows' masks."""
        for row, view in enumerate(views):
            if not isinstance(view, Lookahead) or view.request not in self._rows:
                continue
            slot = self._rows[view.request][len(view.draft) - 1]
            if slot is not None:
                batch_mask = batch_mask or BatchMask([], [])
                batch_mask.logit_rows.append(row)
                batch_mask.slots.append(slot)
        return batch_mask

    def release(self) -> None:
        """Gives the step's spare rows back, once its masks are applied."""
        for rows in self._rows.values():
            for slot in rows:
                if slot is not None:
                    self.masks.return_slot(slot)
        self._rows.clear()
