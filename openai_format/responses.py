"""OpenAI's responses: its chat completion and its chunks, the text completion, models,
usage, logprobs and errors, as the component schemas of its published OpenAPI spec state them
(tests/openai_spec/ holds those schemas; every response is checked against them). A field the
spec makes optional and not nullable is left out when it has no value, never sent as null.

Two extensions: `reasoning_content` on a chat message and its deltas (Qwen3's thinking, as vLLM
names it), and `finish_detail` on a choice that did not end on its own (`cancelled`,
`deadline_exceeded`), whose `finish_reason` is then one of the spec's (`stop`, `length`)."""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from producer_client.chat import ToolCall


def absent(value) -> bool:
    return value is None


Omitted = Field(None, exclude_if=absent)  # an optional field: left out while None


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
    """`text_offset` is left out: the gateway has no tokenizer to place each token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]


class ChatMessageOut(Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = Omitted


class ChatChoice(Response):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: str
    finish_detail: str | None = Omitted


class ChatCompletion(Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    service_tier: str | None = Omitted  # the lane that served it


class FunctionDelta(Response):
    name: str | None = Omitted
    arguments: str


class ToolCallDelta(Response):
    """A call's first chunk has its id, type and name; the next ones add to its arguments."""

    index: int
    id: str | None = Omitted
    type: Literal["function"] | None = Omitted
    function: FunctionDelta


class ChatDelta(Response):
    role: Literal["assistant"] | None = Omitted
    content: str | None = Omitted
    reasoning_content: str | None = Omitted
    tool_calls: list[ToolCallDelta] | None = Omitted


class ChatChunkChoice(Response):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    finish_detail: str | None = Omitted


class ChatCompletionChunk(Response):
    """A chunk of a stream that did not ask for usage (`stream_options.include_usage`): the spec's
    `usage` "will only be present when you set" it, so the field is left out."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Omitted
    service_tier: str | None = Omitted


class UsageCountedChunk(ChatCompletionChunk):
    """A chunk of a stream that asked for usage: `usage` is null in every chunk but the last, the
    usage chunk (choices empty), as the spec's include_usage says."""

    usage: Usage | None = None


class CompletionChoice(Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    finish_detail: str | None = Omitted


class Completion(Response):
    """Both the whole answer and a stream's chunk: OpenAI uses one object for both."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Omitted


class ModelCard(Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mili"
    parent: str | None = None  # a LoRA adapter's base model, as vLLM lists adapters; None for a model


class ModelList(Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Response):
    error: ErrorBody
