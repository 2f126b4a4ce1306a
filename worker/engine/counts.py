"""The engine's running totals of work done, reported by Engine.stats."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.scheduler import ScheduledChunk


@dataclass
class StepCounts:
    steps: int = 0
    computed_tokens: int = 0
    computed_prompt_tokens: int = 0  # of those, prompt tokens (the rest: output tokens fed back)

    def count(self, chunks: list[ScheduledChunk]) -> None:
        self.steps += 1
        self.computed_tokens += sum(c.num_tokens for c in chunks)
        self.computed_prompt_tokens += sum(
            min(c.start + c.num_tokens, c.request.num_prompt_tokens) - c.start
            for c in chunks
            if c.start < c.request.num_prompt_tokens
        )
