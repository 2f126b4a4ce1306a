"""What the speculator asks of a proposer."""

from __future__ import annotations

from typing import Protocol

from worker.engine.request import Request
from worker.engine.scheduler import ScheduledChunk


class Proposer(Protocol):
    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """The step the target just ran, whose model states the next proposal may read."""
        ...

    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        """A draft for each request: up to `limits[i]` tokens to follow requests[i]'s token_ids
        (an empty draft where it has no guess)."""
        ...
