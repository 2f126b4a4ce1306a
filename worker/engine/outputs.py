"""What the engine reports: each step's per-request outputs, offline results, its capacity and
running totals. No torch here: the echo engine and the queue loop use these without a model."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal, NamedTuple

FinishReason = Literal["stop", "length", "abort", "error"]
# A request's id: any hashable value its caller chooses (the worker's loop numbers each admission
# of a job, worker.loop.jobs.AdmissionId); every output carries it back.
RequestId = Hashable


# The engine's own report types are plain tuples and dataclasses, built once per request per
# step on the hot path; the worker turns them into the wire models (producer_client.schema's
# Usage, ErrorInfo, TokenLogprob) in one place, when it publishes (worker/loop/service.py).


# A request's counts: its last output's `usage`, which the worker reads for the job's result. An
# output keeps them as ints and makes this when `usage` is read (see RequestOutput).
class TokenCounts(NamedTuple):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True)
class RequestError:
    code: str
    message: str


@dataclass(frozen=True)
class SampledLogprob:
    """The sampled token's log-probability and the `n` most likely tokens at that position,
    from the model's raw distribution (before penalties, temperature and filtering)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


# An engine makes one output per running request per step. Its counts are kept as three ints and
# read as a TokenCounts (`usage`) when asked, which the worker does only of a request's last
# output: a TokenCounts built per output, by tuple.__new__ in C and freed after the step, was
# about 1,700 instructions of the echo's 6,200 an output (bench/RESULTS.md, z/pub9), and the
# model's reader built it the same way.
#
# Slots: the fields sit in the object itself (Python 3.11 keeps a plain instance's in a second
# allocation), so a step's outputs cost half the allocations and fewer cache lines (x/whole).
# A running request's next token's output, the one made per request per step, is built by
# `token_output` in both engines: object.__new__ and every slot set, not __init__, whose type call
# costs twice a plain function's (283 against 237 ns here; y/pub8). Their tests compare those
# outputs with RequestOutput(...)'s: a field added here must be set there.
class RequestOutput:
    """What one step produced for one request: a delta, or the final word on it. Equal to another
    of the same fields, as a dataclass would be."""

    __slots__ = (
        "request_id",
        "new_token_ids",
        "text_delta",
        "finished",
        "finish_reason",
        "_prompt_tokens",
        "_completion_tokens",
        "_cached_prompt_tokens",
        "logprobs",
        "error",
    )

    request_id: RequestId
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: FinishReason | None
    _prompt_tokens: int
    _completion_tokens: int
    _cached_prompt_tokens: int
    logprobs: list[SampledLogprob] | None
    error: RequestError | None

    def __init__(
        self,
        request_id: RequestId,
        new_token_ids: list[int],
        text_delta: str,
        finished: bool,
        finish_reason: FinishReason | None,
        usage: TokenCounts,
        logprobs: list[SampledLogprob] | None = None,
        error: RequestError | None = None,
    ):
        self.request_id = request_id
        self.new_token_ids = new_token_ids
        self.text_delta = text_delta
        self.finished = finished
        self.finish_reason = finish_reason
        self.usage = usage
        self.logprobs = logprobs
        self.error = error

    @property
    def usage(self) -> TokenCounts:
        return TokenCounts(self._prompt_tokens, self._completion_tokens, self._cached_prompt_tokens)

    @usage.setter
    def usage(self, counts: TokenCounts) -> None:
        self._prompt_tokens, self._completion_tokens, self._cached_prompt_tokens = counts

    def _fields(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in FIELDS)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"RequestOutput({', '.join(f'{n}={v!r}' for n, v in zip(FIELDS, self._fields()))})"


# RequestOutput's fields, in its constructor's order: what its equality compares and its repr shows.
FIELDS = ("request_id", "new_token_ids", "text_delta", "finished", "finish_reason", "usage", "logprobs", "error")


def token_output(
    request_id: RequestId,
    token: int,
    text: str,
    prompt_tokens: int,
    completion_tokens: int,
    cached_prompt_tokens: int,
    logprobs: list[SampledLogprob] | None,
) -> RequestOutput:
    """A running request's output for its next token, not its last; its counts as `usage` has them."""
    out = object.__new__(RequestOutput)
    out.request_id = request_id
    out.new_token_ids = [token]
    out.text_delta = text
    out.finished = False
    out.finish_reason = None
    out._prompt_tokens = prompt_tokens
    out._completion_tokens = completion_tokens
    out._cached_prompt_tokens = cached_prompt_tokens
    out.logprobs = logprobs
    out.error = None
    return out


@dataclass
class GenerationOutput:
    """A finished request from `Engine.generate`."""

    request_id: RequestId
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    usage: TokenCounts
    logprobs: list[SampledLogprob] | None = None
    error: RequestError | None = None


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
    grammar_cache_hits: int = 0  # structured outputs: requests whose grammar was compiled already
    grammar_compiles: int = 0  # grammars compiled (cache misses), failures included
    grammar_compile_seconds: float = 0.0  # the time those compiles took, on the compile thread
    drafts: int = 0  # speculative decoding: drafts verified (a request's, in a step)
    draft_tokens: int = 0  # the tokens they held
    accepted_draft_tokens: int = 0  # of those, accepted as output
    adapter_reads: int = 0  # LoRA adapters read from disk
    adapter_installs: int = 0  # LoRA adapters installed in a device slot
