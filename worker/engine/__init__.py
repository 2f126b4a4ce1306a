"""The inference engine: paged KV cache, radix prefix cache, continuous batching, sampling.

Names load on first use (PEP 562): `worker.engine.settings` is imported by the worker's
settings, and the healthcheck must not pay for importing torch to read them.
"""

import importlib

_HOMES = {
    "Engine": "engine",
    "Capacity": "outputs",
    "EngineStats": "outputs",
    "GenerationOutput": "outputs",
    "RequestError": "outputs",
    "RequestOutput": "outputs",
    "SampledLogprob": "outputs",
    "TokenCounts": "outputs",
    "EngineSettings": "settings",
}
__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
