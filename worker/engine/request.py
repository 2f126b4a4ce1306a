"""A request's state as it moves through the engine, and what the engine reports about it."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

from producer_client.schema import SamplingParams

if TYPE_CHECKING:
    from worker.engine.radix_cache import TreeNode
    from worker.engine.stop import TextOutput

FinishReason = Literal["stop", "length", "abort", "error"]


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


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


class Request:
    """One sequence: its tokens (prompt then output), how many have KV in the cache, and its pages.

    The model always extends `token_ids[num_computed_tokens:]`; when that reaches the end
    of the sequence the step samples a token. After preemption `num_computed_tokens` drops
    to 0 and the whole sequence, outputs included, is recomputed (minus any cached prefix).
    """

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int, arrival: int, text: TextOutput, generator: torch.Generator | None,
    ):
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival = arrival
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.pages: list[int] = []
        self.cache_node: TreeNode | None = None
        self.num_cached_prompt_tokens = 0  # found in the prefix cache at first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: ErrorInfo | None = None
        self.text = text
        self.generator = generator
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs sooner: priority first (lower number = more urgent, as in vLLM), then arrival."""
        return (self.priority, self.arrival)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def usage(self) -> Usage:
        return Usage(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_prompt_tokens)

    def finish(self, reason: FinishReason, error: ErrorInfo | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
