"""A request's output text: incremental detokenization plus stop-string matching.

Text that could be the start of a stop string is held back until the next tokens show it
is not, so a stream never carries text that is later cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Detokenizer(Protocol):
    def push(self, new_ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...


class StopStringMatcher:
    def __init__(self, stops: list[str]):
        self.stops = stops
        self._held = ""

    def push(self, delta: str, can_stop: bool) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string ended the text).

        On a match the text is cut where the earliest stop string begins; the stop string
        and anything after it are dropped. Before `can_stop` (min_tokens not reached) no
        match ends the text, but partial matches are still held so one completing later
        is found whole.
        """
        text = self._held + delta
        if can_stop:
            cut = self._earliest_match(text)
            if cut is not None:
                self._held = ""
                return text[:cut], True
        keep = self._partial_match_len(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep], False

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best


class TextOutput:
    """Turns sampled tokens into emitted text for one request and accumulates it.

    The text is kept as its deltas and joined when read: appending to one string attribute
    would copy the whole text for every token."""

    def __init__(self, detokenizer: Detokenizer, stops: list[str]):
        self.detokenizer = detokenizer
        self.matcher = StopStringMatcher(stops) if stops else None
        self._deltas: list[str] = []

    @property
    def text(self) -> str:
        return "".join(self._deltas)

    def push(self, token_id: int, can_stop: bool) -> tuple[str, bool]:
        delta = self.detokenizer.push((token_id,))
        stopped = False
        if self.matcher is not None:
            delta, stopped = self.matcher.push(delta, can_stop)
        if delta:
            self._deltas.append(delta)
        return delta, stopped

    def finish(self) -> str:
        """The rest of the text when the request ends other than by a stop string: what the
        matcher held back, then what the detokenizer held (an unfinished character as U+FFFD)."""
        delta = self.detokenizer.flush()
        if self.matcher is not None:
            delta = self.matcher.flush() + delta
        if delta:
            self._deltas.append(delta)
        return delta
