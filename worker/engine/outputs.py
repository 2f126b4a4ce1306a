"""What the engine reports: each step's per-request outputs, offline results, its capacity and
running totals. No torch here: the echo engine and the queue loop use these without a model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True)
class ErrorInfo:
    code: str
    message: str


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the `n` most likely tokens at that position,
    from the model's raw distribution (before penalties, temperature and filtering)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass
class RequestOutput:
    """What one step produced for one request: a delta, or the final word on it."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    error: ErrorInfo | None = None


@dataclass
class GenerationOutput:
    """A finished request from `Engine.generate`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    logprobs: list[TokenLogprob] | None = None
    error: ErrorInfo | None = None


@dataclass(frozen=True)
class Capacity:
    """What the queue loop may still hand over: request slots, and KV pages not yet spoken for."""

    free_slots: int
    free_pages: int
    page_size: int


@dataclass(frozen=True)
class EngineStats:
    steps: int
    computed_tokens: int  # tokens the model ran (prefill chunks, recomputation and decodes)
    computed_prompt_tokens: int  # of those, prompt positions; cache hits are not among them
    preemptions: int
    cache_queried_tokens: int  # prompt tokens looked up in the prefix cache at admission
    cache_hit_tokens: int  # of those, found cached
