"""OpenAI requests as queue jobs: one job per choice (`n`, times the prompts of a completion),
each checked by the client library's own validation before any is enqueued."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gateway.errors import bad_request
from gateway.schema import (
    MAX_CHOICES, ChatCompletionRequest, ChatMessageIn, CompletionRequest, GenerateRequest, SamplingRequest,
)
from producer_client import protocol

# OpenAI's default for text completions. A chat runs to the client library's default
# (SamplingParams.max_tokens) where OpenAI runs to the end of the context: the gateway has no
# tokenizer to know where that is.
COMPLETION_MAX_TOKENS = 16
# Where a field is a union, pydantic names the member that failed inside the error's location
# (`messages.0.content.str`); fields are snake_case, members are types.
UNION_MEMBER = re.compile(r"str|int|float|bool|(list|dict)\[.*\]|[A-Z]\w*")
Model = TypeVar("Model", bound=BaseModel)
# SamplingRequest fields that pass to SamplingParams under the same name.
SAMPLING_FIELDS = (
    "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p", "min_tokens",
    "repetition_penalty", "ignore_eos", "stop_token_ids",
)


@dataclass(frozen=True)
class JobSpec:
    """The arguments of one `AsyncClient.submit`."""

    prompt: str | None = None
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    priority: int = 0
    sampling: dict[str, Any] | None = None
    prompt_index: int = 0  # which prompt of a completion this job answers

    def submit_kwargs(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt, "messages": self.messages, "input_ids": self.input_ids,
            "priority": self.priority, **(self.sampling or {}),
        }

    def check(self, timeout_s: float) -> None:
        """Validate as `submit` will, touching nothing: raises InvalidArgument."""
        protocol.build_job(self.prompt, self.messages, self.input_ids, None, timeout_s, self.priority, self.sampling or {})


def parse_body(model: type[Model], body: bytes | str) -> Model:
    """A request body as `model`, strictly from its JSON; a 400 naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if not UNION_MEMBER.fullmatch(str(p))) or None
        if first["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param, "unsupported_parameter") from None
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param) from None


def chat_jobs(req: ChatCompletionRequest) -> list[JobSpec]:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    base = JobSpec(messages=[chat_message(m) for m in req.messages], priority=req.priority or 0,
                   sampling=sampling(req, max_tokens, logprobs))
    return choices(base, req.n)


def completion_jobs(req: CompletionRequest) -> list[JobSpec]:
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_MAX_TOKENS
    params = sampling(req, max_tokens, req.logprobs)
    prompts = prompt_list(req.prompt)
    if len(prompts) * req.n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts times n={req.n} exceeds {MAX_CHOICES} choices", "n")
    jobs: list[JobSpec] = []
    for index, prompt in enumerate(prompts):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        jobs += choices(JobSpec(prompt=text, input_ids=ids, priority=req.priority or 0, sampling=params, prompt_index=index), req.n)
    return jobs


def generate_job(req: GenerateRequest) -> JobSpec:
    given = {"max_tokens": req.max_tokens, "temperature": req.temperature, "top_p": req.top_p}
    return JobSpec(prompt=req.prompt, sampling={k: v for k, v in given.items() if v is not None})


def choices(base: JobSpec, n: int) -> list[JobSpec]:
    """n jobs of one prompt. With a seed, choice i samples with seed + i: n jobs of one seed would
    all draw the same tokens, while the same request still gives the same n choices."""
    seed = (base.sampling or {}).get("seed")
    if seed is None or n == 1:
        return [base] * n
    return [replace(base, sampling={**base.sampling, "seed": seed + i}) for i in range(n)]


def sampling(req: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    params = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if logprobs is not None:
        params["logprobs"] = logprobs
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    return params


def chat_message(message: ChatMessageIn) -> dict[str, str]:
    # OpenAI's `developer` role is the system prompt of newer models; the chat template knows `system`.
    role = "system" if message.role == "developer" else message.role
    content = message.content if isinstance(message.content, str) else "".join(p.text for p in message.content)
    return {"role": role, "content": content}


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """A completion's prompts: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
