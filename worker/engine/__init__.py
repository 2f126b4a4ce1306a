"""The inference engine: paged KV cache, radix prefix cache, continuous batching, sampling."""
from worker.engine.engine import Capacity, Engine, EngineStats
from worker.engine.request import GenerationOutput, RequestOutput, TokenLogprob, Usage
from worker.engine.settings import EngineSettings

__all__ = [
    "Capacity", "Engine", "EngineSettings", "EngineStats", "GenerationOutput", "RequestOutput",
    "TokenLogprob", "Usage",
]
