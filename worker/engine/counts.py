"""The engine's running totals of work done, and Engine.stats gathering them with its parts' own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from worker.engine.outputs import EngineStats
from worker.engine.scheduler import ScheduledChunk

if TYPE_CHECKING:
    from worker.engine.grammar.compiler import GrammarCompiler
    from worker.engine.lora.manager import LoraManager
    from worker.engine.radix_cache import RadixCache
    from worker.engine.scheduler import Scheduler
    from worker.engine.speculative.speculator import Speculator


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


def engine_stats(
    counts: StepCounts,
    scheduler: Scheduler,
    cache: RadixCache,
    grammars: GrammarCompiler,
    speculator: Speculator | None,
    lora: LoraManager | None,
) -> EngineStats:
    """The steps' totals with the scheduler's, the prefix cache's, the grammar compiler's, the
    speculator's (drafts verified) and the LoRA manager's (adapters read and installed)."""
    compiled = grammars.stats
    return EngineStats(
        counts.steps,
        counts.computed_tokens,
        counts.computed_prompt_tokens,
        scheduler.num_preemptions,
        cache.queried_tokens,
        cache.hit_tokens,
        compiled.cache_hits,
        compiled.compiles,
        compiled.compile_seconds,
        *(speculator.totals if speculator is not None else (0, 0, 0)),
        *((lora.loader.reads, lora.slots.installs) if lora is not None else ()),
    )
