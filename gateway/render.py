"""Job results and token deltas as OpenAI's objects: whole chat and text completions, their stream
chunks, usage and logprobs.

The gateway has no tokenizer, so a token in `logprobs` is written as `token_id:<id>` (vLLM's
`--return-tokens-as-token-ids` form), with the bytes of that string.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.errors import deadline_passed
from gateway.schema import (
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobs, ChatMessageOut,
    Completion, CompletionChoice, CompletionLogprobs, PromptTokensDetails, TokenLogprob, TopLogprob, Usage,
)
from producer_client import JobResult, TokenDelta
from producer_client.schema import TokenLogprob as JobLogprob


def token_name(token_id: int) -> str:
    return f"token_id:{token_id}"


def finish_reason(result: JobResult) -> str:
    """OpenAI's finish_reason of a finished job: stop or length, or vLLM's abort for a job that
    was cancelled. A job that passed its deadline is a 504 (raised)."""
    if result.status == "expired" or result.finish_reason == "timeout":
        raise deadline_passed(f"job {result.id} passed its deadline after {result.usage.completion_tokens} tokens")
    return "abort" if result.status == "cancelled" else result.finish_reason or "stop"


def usage(results: list[JobResult], prompt_of: list[int]) -> Usage:
    """Prompt tokens count once per prompt (n choices of one prompt share it, as OpenAI counts)."""
    first_of_prompt = {p: r for r, p in reversed(list(zip(results, prompt_of)))}
    prompt = sum(r.usage.prompt_tokens for r in first_of_prompt.values())
    cached = sum(r.usage.cached_prompt_tokens for r in first_of_prompt.values())
    completion = sum(r.usage.completion_tokens for r in results)
    return Usage(
        prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def chat_logprobs(logprobs: list[JobLogprob] | None) -> ChatLogprobs | None:
    if logprobs is None:
        return None
    return ChatLogprobs(content=[chat_token(lp) for lp in logprobs])


def chat_token(lp: JobLogprob) -> TokenLogprob:
    name = token_name(lp.token_id)
    return TokenLogprob(
        token=name, logprob=lp.logprob, bytes=list(name.encode()), top_logprobs=[top_logprob(t, v) for t, v in lp.top],
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
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, results: list[JobResult]) -> Usage:
        return usage(results, self.prompt_of)


class ChatRenderer(Renderer):
    def response(self, results: list[JobResult]) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=i, message=ChatMessageOut(content=r.text), logprobs=chat_logprobs(r.logprobs),
                finish_reason=finish_reason(r),
            )
            for i, r in enumerate(results)
        ]
        return ChatCompletion(id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage(results))

    def first(self, index: int) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content="")))

    def delta(self, index: int, delta: TokenDelta) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(content=delta.text), logprobs=chat_logprobs(delta.logprobs)))

    def end(self, index: int, result: JobResult) -> ChatCompletionChunk:
        return self._chunk(ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=finish_reason(result)))

    def usage_chunk(self, results: list[JobResult]) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage(results))

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])


class CompletionRenderer(Renderer):
    def response(self, results: list[JobResult]) -> Completion:
        choices = [
            CompletionChoice(index=i, text=r.text, logprobs=completion_logprobs(r.logprobs), finish_reason=finish_reason(r))
            for i, r in enumerate(results)
        ]
        return Completion(id=self.id, created=self.created, model=self.model, choices=choices, usage=self.usage(results))

    def first(self, index: int) -> None:
        return None  # a text completion's stream has no role chunk

    def delta(self, index: int, delta: TokenDelta) -> Completion:
        return self._chunk(CompletionChoice(
            index=index, text=delta.text, logprobs=completion_logprobs(delta.logprobs), finish_reason=None,
        ))

    def end(self, index: int, result: JobResult) -> Completion:
        return self._chunk(CompletionChoice(index=index, text="", logprobs=None, finish_reason=finish_reason(result)))

    def usage_chunk(self, results: list[JobResult]) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage(results))

    def _chunk(self, choice: CompletionChoice) -> Completion:
        return Completion(id=self.id, created=self.created, model=self.model, choices=[choice])
