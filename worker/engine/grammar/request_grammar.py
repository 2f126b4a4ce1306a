"""One request's grammar: its matcher, compiled off the loop, advanced by each output token the
request keeps.

The reader hands the matcher a token only when it takes it as the request's (StepReader), never a
draw that is discarded (a request that ended while the token was in flight, non-finite logits),
so there is nothing to roll back. A preempted request keeps its tokens and recomputes their KV,
and its matcher stays where it was. A request added with the tokens of an earlier run (a resumed
job) gets a fresh matcher that consumes them first, on the compile thread. If they complete the
grammar, that run was ending: it had read its last token and died before the end that follows
one (below). The request starts complete and ends as "stop" once compiled, drawing nothing.

The matcher consumes a token on the mask thread, just before it fills the request's next mask
(masks.py), not on the loop: the token was drawn under the matcher's own mask, so it is known to
be allowed, and whether it completed the grammar is learnt there. A request whose output the
grammar found complete ends when its next token is read, without that token (its mask allowed
nothing but the end); at max_tokens the reader asks at once, so an output that closes on its last
token ends as "stop", not "length".
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from producer_client.errors import InvalidArgument, MiliError
from worker.engine.grammar.constraint import Constraint, Phase


@dataclass
class MatcherState:
    matcher: Any  # llguidance.LLMatcher
    phase: Phase  # where the output is: before, in or after its reasoning (constraint.Thinking)
    complete: bool  # the tokens replayed into it completed the grammar


def replayed(constraint: Constraint, tokens: Sequence[int], matcher: Any) -> MatcherState:
    """The matcher after the output tokens an earlier run produced; InvalidArgument if the grammar
    refuses them."""
    phase = constraint.first_phase
    for n, token in enumerate(tokens, 1):
        phase, answers = constraint.after(phase, token)
        if answers and not matcher.consume_token(token):
            raise InvalidArgument("resume_token_ids", f"the grammar refuses token {n}: {matcher.get_error()}")
    return MatcherState(matcher, phase, matcher.is_stopped())


class RequestGrammar:
    def __init__(self, constraint: Constraint, compiled: Future[MatcherState], end_token_ids: Sequence[int]):
        self.constraint = constraint
        self.end_token_ids = tuple(end_token_ids)  # what ends the request where the grammar accepts: stop ids, EOS
        self._compiled = compiled
        self.matcher: Any = None
        self.phase = constraint.first_phase
        self.pending: int | None = None  # a token taken and not yet consumed
        self.complete = False  # the output is whole: nothing but its end may follow
        self.error: str | None = None  # the matcher refused a token, or allows none
        self.position = 0  # output tokens taken since it started: what a filled mask row is for
        self.slot: int | None = None  # its row in the mask table (masks.py), while it has one
        self.filled_at = -1  # the position its row was filled at
        self.release_slot = None  # given with the slot

    @property
    def compiled(self) -> bool:
        return self._compiled.done()

    def wait_compiled(self, timeout_s: float) -> None:
        futures.wait([self._compiled], timeout=timeout_s)

    @property
    def started(self) -> bool:
        return self.matcher is not None

    def start(self) -> MiliError | None:
        """Takes the compiled matcher; the error instead if it did not compile."""
        try:
            state = self._compiled.result()
        except MiliError as error:
            return error
        self.matcher, self.phase, self.complete = state.matcher, state.phase, state.complete
        return None

    def take(self, token: int) -> None:
        """The request's next output token, to be consumed by `advance` if it is the answer's
        (in the reasoning before it, only watched for its end)."""
        self.position += 1
        self.phase, answers = self.constraint.after(self.phase, token)
        if answers:
            self.pending = token

    def advance(self) -> None:
        """Consumes the pending token; learns whether it completed the grammar."""
        if self.pending is None:
            return
        token, self.pending = self.pending, None
        if not self.matcher.consume_token(token):
            self.error = f"the grammar refuses output token {token}: {self.matcher.get_error()}"
        elif self.matcher.is_stopped():
            self.complete = True

    @property
    def ended(self) -> bool:
        """Nothing more may be drawn: the output is whole, or the grammar failed."""
        return self.complete or self.error is not None

    @property
    def accepts_end(self) -> bool:
        """Whether the output may end here (every token taken has been consumed)."""
        return self.phase is not Phase.THINKING and self.matcher.is_accepting()

    def close(self) -> None:
        """The request has ended: its mask row goes back. `slot` stays as it is: the mask thread
        may be filling the row (it is given to another request only once that fill is over)."""
        if self.release_slot is not None:
            self.release_slot()
            self.release_slot = None
