"""Job results and token deltas as OpenAI's objects: whole chat and text completions, their stream
chunks, usage and logprobs. A chat's reasoning and tool calls come split from its answer already
(the worker's result, the client's stream: producer_client.chat_output).

Only the worker has a tokenizer, so a token in `logprobs` is written as `token_id:<id>` (vLLM's
`--return-tokens-as-token-ids` form), with the bytes of that string.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from openai_format.errors import deadline_passed
from openai_format.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionDelta,
    PromptTokensDetails,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
    UsageCountedChunk,
)
from producer_client import JobResult, TokenDelta
from producer_client.chat import ToolCall
from producer_client.schema import TokenLogprob as JobLogprob

SPEC_REASONS = frozenset({"stop", "length", "tool_calls"})  # of the spec's enum, those a job can end with


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def finish_reason(result: JobResult) -> tuple[str, str | None]:
    """The choice's finish_reason, from the spec's enum, and why it ended when it did not end on
    its own (the `finish_detail` extension): a cancelled job stopped (`stop`), one past its
    deadline was cut short (`length`). A job that expired before it ran has no answer: a 504."""
    if result.status == "expired":
        raise deadline_passed(f"job {result.id} passed its deadline before it started")
    if result.status == "cancelled":
        return "stop", "cancelled"
    if result.finish_reason == "timeout":
        return "length", "deadline_exceeded"
    if result.finish_reason in SPEC_REASONS:
        return result.finish_reason, None
    return "stop", result.finish_reason


def usage(results: list[JobResult], prompt_of: list[int]) -> Usage:
    """Prompt tokens count once per prompt (n choices of one prompt share it, as OpenAI counts)."""
    first_of_prompt = {p: r for r, p in reversed(list(zip(results, prompt_of)))}
    prompt = sum(r.usage.prompt_tokens for r in first_of_prompt.values())
    cached = sum(r.usage.cached_prompt_tokens for r in first_of_prompt.values())
    completion = sum(r.usage.completion_tokens for r in results)
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def chat_logprobs(logprobs: list[JobLogprob] | None) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    return ChatLogprobs(content=[chat_token(lp) for lp in logprobs])


def chat_token(lp: JobLogprob) -> TokenLogprob:
    name = token_name(lp.token_id)
    return TokenLogprob(
        token=name,
        logprob=lp.logprob,
        bytes=list(name.encode()),
        top_logprobs=[top_logprob(t, v) for t, v in lp.top],
    )


def top_logprob(token_id: int, logprob: float) -> TopLogprob:
    name = token_name(token_id)
    return TopLogprob(token=name, logprob=logprob, bytes=list(name.encode()))


def completion_logprobs(logprobs: list[JobLogprob] | None) -> CompletionLogprobs | None:
    if logprobs is None:
        return None
    return CompletionLogprobs(
        tokens=[token_name(lp.token_id) for lp in logprobs],
        token_logprobs=[lp.logprob for lp in logprobs],
        top_logprobs=[{token_name(t): v for t, v in lp.top} for lp in logprobs],
    )


@dataclass
class Renderer:
    """One request's answer: its id, model, creation time and which prompt each job answers."""

    id: str
    model: str
    prompt_of: list[int]  # job index -> prompt index
    service_tier: str | None = None  # the lane of its jobs, which a chat's answer echoes
    include_usage: bool = False  # a stream's stream_options.include_usage: a last chunk of the usage
    created: int = field(default_factory=lambda: int(time.time()))
    calls_streamed: dict[int, int] = field(default_factory=dict)  # choice index -> its tool calls sent so far

    def usage(self, results: list[JobResult]) -> Usage:
        return usage(results, self.prompt_of)


class ChatRenderer(Renderer):
    def response(self, results: list[JobResult]) -> ChatCompletion:
        choices = [
            ChatChoice(index=i, message=message(r), logprobs=chat_logprobs(r.logprobs), **choice_end(r))
            for i, r in enumerate(results)
        ]
        return ChatCompletion(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(results),
            service_tier=self.service_tier,
        )

    def first(self, index: int) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))

    def delta(self, index: int, delta: TokenDelta) -> list[ChatCompletionChunk]:
        """The delta's text (answer, reasoning, with its logprobs), then each call it completed: a
        chunk with its id and name, and one with its arguments."""
        chunks = []
        if delta.text or delta.reasoning or delta.logprobs:
            text = ChatDelta(content=delta.text or None, reasoning_content=delta.reasoning or None)
            if delta.logprobs and not (delta.text or delta.reasoning):
                text = ChatDelta(content="")
            chunks.append(self._chunk(ChatChunkChoice(index=index, delta=text, logprobs=chat_logprobs(delta.logprobs))))
        for call in delta.tool_calls:
            position = self.calls_streamed.get(index, 0)
            self.calls_streamed[index] = position + 1
            chunks += [
                self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=[part])))
                for part in call_parts(position, call)
            ]
        return chunks

    def end(self, index: int, result: JobResult) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(), **choice_end(result)))

    def usage_chunk(self, results: list[JobResult]) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=self.usage(results),
            service_tier=self.service_tier,
        )

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        kind = UsageCountedChunk if self.include_usage else ChatCompletionChunk
        return kind(
            id=self.id, created=self.created, model=self.model, choices=[choice], service_tier=self.service_tier
        )


def message(result: JobResult) -> ChatMessageOut:
    """A message that only calls tools has null content, as OpenAI's."""
    content = result.text if result.text or not result.tool_calls else None
    return ChatMessageOut(
        content=content, reasoning_content=result.reasoning or None, tool_calls=result.tool_calls or None
    )


def call_parts(index: int, call: ToolCall) -> list[ToolCallDelta]:
    """A call as OpenAI streams it: its index among the choice's calls, its id, type and name
    once, then its arguments as a string delta."""
    return [
        ToolCallDelta(
            index=index, id=call.id, type="function", function=FunctionDelta(name=call.function.name, arguments="")
        ),
        ToolCallDelta(index=index, function=FunctionDelta(arguments=call.function.arguments)),
    ]


def choice_end(result: JobResult) -> dict:
    reason, detail = finish_reason(result)
    return {"finish_reason": reason, "finish_detail": detail}


class CompletionRenderer(Renderer):
    def response(self, results: list[JobResult]) -> Completion:
        choices = [
            CompletionChoice(index=i, text=r.text, logprobs=completion_logprobs(r.logprobs), **choice_end(r))
            for i, r in enumerate(results)
        ]
        return Completion(
            id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage(results)
        )

    def first(self, index: int) -> None:
        return None  # a text completion's stream has no role chunk

    def delta(self, index: int, delta: TokenDelta) -> list[Completion]:
        if not (delta.text or delta.logprobs):
            return []
        return [
            self._chunk(
                CompletionChoice(
                    index=index,
                    text=delta.text,
                    logprobs=completion_logprobs(delta.logprobs),
                    finish_reason=None,
                )
            )
        ]

    def end(self, index: int, result: JobResult) -> Completion:
        return self._chunk(CompletionChoice(index=index, text="", logprobs=None, **choice_end(result)))

    def usage_chunk(self, results: list[JobResult]) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage(results))

    def _chunk(self, choice: CompletionChoice) -> Completion:
        # No `"usage": null` even with include_usage: the spec's chunk is CreateCompletionResponse,
        # whose usage is not nullable, so only the usage chunk has the field.
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])
