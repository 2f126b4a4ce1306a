"""The speculator a worker's settings ask for."""

from __future__ import annotations

from worker.engine.settings import EngineSettings
from worker.engine.speculative.ngram import NgramProposer
from worker.engine.speculative.speculator import Speculator


def build_speculator(settings: EngineSettings, max_model_len: int) -> Speculator | None:
    if settings.speculative_method is None:
        return None
    return Speculator(NgramProposer(), settings.num_speculative_tokens, max_model_len)
