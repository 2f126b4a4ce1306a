"""The HTTP boundary's shapes: OpenAI's request and response objects (chat completions,
completions, models, errors, usage) with vLLM's sampling extras, and the seed's /generate.

Requests are parsed strictly from JSON and forbid unknown fields, so that a parameter this
gateway does not implement (`tools`, `response_format`, `logit_bias`, ...) is refused with a 400
naming it instead of being silently ignored. A field sent as null means "the default", as the
SDKs send it.
"""
from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_CHOICES = 128  # jobs one request may create: n, times the prompts of a completion

NonEmptyIds = Annotated[list[int], Field(min_length=1)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingRequest(Strict):
    """What chat and text completions share. Sampling fields map one to one onto the client's
    SamplingParams, which checks their ranges (see gateway.requests)."""

    model: str
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted and logged; it steers nothing
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras, in the body as vLLM takes them.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessageIn(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None  # accepted; the chat template does not use it
    tool_call_id: str | None = None  # accepted on tool messages; tool calls are not supported


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(SamplingRequest):
    prompt: str | Annotated[list[str], Field(min_length=1)] | NonEmptyIds | Annotated[list[NonEmptyIds], Field(min_length=1)]
    logprobs: int | None = None

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt_form(cls, value, handler):
        # One message instead of one per member of the union.
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string, a list of strings, a list of token ids or a list of such lists") from None


class GenerateRequest(Strict):
    """The seed's POST /generate."""

    prompt: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    model: str | None = None  # none: the gateway's default_queue


# -- responses ---------------------------------------------------------------------------------


class Response(BaseModel):
    model_config = ConfigDict(frozen=True)


class PromptTokensDetails(Response):
    cached_tokens: int


class Usage(Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Response):
    content: list[TokenLogprob]
    refusal: None = None


class CompletionLogprobs(Response):
    """`text_offset` is left out (null): the gateway has no tokenizer to place each token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: None = None


class ChatMessageOut(Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str


class ChatCompletion(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(Response):
    """Both the whole answer and a stream's chunk: OpenAI uses one object for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mili"


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class GenerateResponse(Response):
    generated_text: str
    finish_reason: str
    usage: Usage


class Health(Response):
    status: Literal["ok"] = "ok"
    model_loaded: bool
    models: list[str]


class ErrorBody(Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Response):
    error: ErrorBody
