"""OpenAI requests as queue jobs: one job per choice (`n`, times the prompts of a completion),
each checked by the client library's own validation before any is enqueued."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypeVar

from pydantic import BaseModel, ValidationError

from openai_format.errors import APIError, bad_request, bound_code, length_code, unsupported
from openai_format.requests import (
    MAX_CHOICES,
    AssistantMessage,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
    TextPart,
    ToolMessage,
    Unsupported,
)
from producer_client.errors import BodyTooLarge, InvalidArgument
from producer_client.new_job import NewJob, build_job
from producer_client.schema import BOUNDS, UNION_MEMBER, is_decimal_bound
from producer_client.structured import check_format, format_from_json

# OpenAI's default for text completions. A chat runs to the client library's default
# (SamplingParams.max_tokens) where OpenAI runs to the end of the context: neither the gateway nor
# `mili batch` has a tokenizer to know where that is.
COMPLETION_MAX_TOKENS = 16
# Where a field is a tagged union, pydantic names the tag of the member that failed after the
# field (`response_format.json_schema.json_schema.name`): each such field by its path (int: any
# list index), with the field its tag is in, which an error about the tag itself names.
TAGGED_UNIONS = {("messages", int): "role", ("response_format",): "type"}
Model = TypeVar("Model", bound=BaseModel)
# SamplingRequest fields that pass to SamplingParams under the same name.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "min_tokens",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
)
SEEDS = 2**63  # the spec's seeds are int64, the client's non-negative: a negative one counts from the top
# pydantic's error types as OpenAI's error codes, besides bounds, lengths and types (error_code).
ERROR_CODES = {
    "missing": "missing_required_parameter",
    "extra_forbidden": "unknown_parameter",
    "string_too_long": "string_above_max_length",  # OpenAI's "string too long"
}


@dataclass(frozen=True)
class JobSpec:
    """The arguments of one `AsyncClient.submit`."""

    prompt: str | None = None
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    priority: int = 0
    sampling: dict[str, Any] | None = None
    prompt_index: int = 0  # which prompt of a completion this job answers
    adapter: str | None = None  # the LoRA adapter the request's model names (gateway/registry.py)
    service_tier: str | None = None  # its lane (None: the submitter's default)

    def submit_kwargs(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "messages": self.messages,
            "input_ids": self.input_ids,
            "priority": self.priority,
            "service_tier": self.service_tier,
            **self.options(),
        }

    def options(self) -> dict[str, Any]:
        """The sampling parameters and job options submit takes among them."""
        return {**(self.sampling or {}), **({"adapter": self.adapter} if self.adapter is not None else {})}

    def check(self, timeout_s: float | None, stream: bool = False) -> NewJob:
        """Validate as `submit` will, touching nothing: raises InvalidArgument. Returns the job as
        submit would build it: its body, and its tokens as a tokens-per-minute limit counts them
        (NewJob.cost)."""
        prompt, messages, ids, tier = self.prompt, self.messages, self.input_ids, self.service_tier
        options = self.options()
        return build_job(prompt, messages, ids, None, timeout_s, self.priority, options, None, stream, tier)


class JobsSize(NamedTuple):
    tokens: int  # the jobs' together (NewJob.cost)
    bytes: int  # their bodies' together, a prompt's choices counted as its first job's size each


def check_jobs(specs: list[JobSpec], timeout_s: float | None, stream: bool, max_bytes: int | None) -> JobsSize:
    """Every job of a request validated as `submit` will, before the first is enqueued; returns
    their tokens and bytes together. A job equal to the one before it (the n choices of a
    prompt without a seed) is not checked again: it passes and costs as that one did, and n=128
    choices of a long prompt were 128 checks of 130 ms each.
    Their bodies together must fit `max_bytes` (None: no bound), else BodyTooLarge naming `n`
    (or, for a completion's prompts of one choice each, `prompt`): every choice of a prompt holds
    the whole prompt, and n=128 choices of a 0.9 MiB one put 121 MB of jobs in Redis. A prompt's choices
    count as its first job's size each (a seed's choices differ from it by the seed's digits, a
    few bytes), added as its first job is built: a request over the bound is refused before the
    choices that pass it are built."""
    n = len(specs) // (specs[-1].prompt_index + 1)  # the choices of each prompt, in order (completion_jobs)
    tokens, total_bytes, previous, cost = 0, 0, None, 0
    for spec in specs:
        if spec != previous:
            job = spec.check(timeout_s, stream)
            if previous is None or spec.prompt_index != previous.prompt_index:  # a prompt's first job
                total_bytes += len(job.body.encode()) * n
                check_jobs_bytes(total_bytes, max_bytes, len(specs), n)
            previous, cost = spec, job.cost
        tokens += cost
    return JobsSize(tokens, total_bytes)


def check_jobs_bytes(total_bytes: int, max_bytes: int | None, jobs: int, n: int) -> None:
    """Refuses a request whose jobs' bodies take `total_bytes` at least (check_jobs), past `max_bytes`."""
    if max_bytes is None or total_bytes <= max_bytes:
        return
    raise BodyTooLarge(
        "n" if n > 1 else "prompt",
        f"the request's {jobs} jobs ({n} choices a prompt, each a job that holds the whole prompt) take "
        f"{total_bytes} bytes or more, over this server's limit of {max_bytes} bytes a request: lower n or shorten "
        "the prompt",
    )


def named_as_requested(error: InvalidArgument, req: SamplingRequest) -> InvalidArgument:
    """The client library's error on a request's job, naming the field as the request does where
    the two names differ: a completion's token ids are its `prompt` (the client's `input_ids`),
    and a chat's `max_completion_tokens` is the client's `max_tokens`."""
    field = error.field
    if field == "input_ids":
        field = "prompt"
    elif field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        field = "max_completion_tokens"
    if field == error.field:
        return error
    return error.named(field)


def parse_body(model: type[Model], body: bytes | str) -> Model:
    """A request body as `model`, strictly from its JSON; a 400 naming the first bad field."""
    try:
        return model.model_validate_json(body, strict=True)
    except ValidationError as e:
        first = telling(e.errors())
        if first["type"] == "json_invalid" and (overlong := overlong_integer(body)) is not None:
            raise overlong from None
        param = param_of(first)
        if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
            raise tag_error(first, param) from None
        if first["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param, "unknown_parameter") from None
        if isinstance(first.get("ctx", {}).get("error"), Unsupported):
            raise unsupported(f"{param} {first['ctx']['error']}", param) from None
        code = error_code(first, "invalid_value") if param else "invalid_json"  # a body that is no object
        raise bad_request(f"{param}: {first['msg']}" if param else first["msg"], param, code) from None


def tag_error(error: dict, param: str | None) -> APIError:
    """The 400 for a tagged union's member that its tag does not pick (a message's `role`, a
    response_format's `type`), worded as any field's: pydantic's own message names how the tag is
    read (`<lambda>()` for a message's), and its error for a member that is not an object, or has
    no tag, read as an invalid value of the tag."""
    container = param.rsplit(".", 1)[0] if param else None
    if not isinstance(error["input"], dict):
        return bad_request(f"{container}: Input should be an object", container, "invalid_type")
    if error["type"] == "union_tag_not_found":
        return bad_request(f"{param}: Field required", param, "missing_required_parameter")
    tags = error["ctx"]["expected_tags"]
    return bad_request(f"{param}: Input tag {error['ctx']['tag']!r} is none of the expected tags: {tags}", param)


class OverlongInteger(NamedTuple):
    """An integer literal of more digits than Python converts (sys.get_int_max_str_digits, 4300),
    as overlong_integer reads it."""

    negative: bool
    digits: int


def overlong_integer(body: bytes | str) -> APIError | None:
    """The error of a body that is JSON but holds an integer of more than 4,300 digits, naming
    where: the parser refuses such a number (converting it costs time quadratic in its digits,
    CVE-2020-10735) as invalid JSON, naming no field. Read again here, on that refusal only, with
    such numbers marked. None: the body is not JSON for another reason too."""
    limit = sys.get_int_max_str_digits()

    def parse_int(literal: str) -> int | OverlongInteger:
        digits = len(literal.lstrip("-"))
        return int(literal) if digits <= limit else OverlongInteger(literal.startswith("-"), digits)

    try:
        found = first_path_to(json.loads(body, parse_int=parse_int), OverlongInteger)
    except (ValueError, RecursionError):
        return None
    if found is None:
        return None
    path, number = found
    param = ".".join(map(str, path)) or None
    code = bound_code(number.negative, decimal=False)
    return bad_request(
        f"{param}: an integer of {number.digits} digits, over the {limit} this server reads", param, code
    )


def first_path_to(node: Any, kind: type) -> tuple[tuple, Any] | None:
    """(the keys and indexes to the first value of `kind` in a JSON document, the value), in document order."""
    if isinstance(node, kind):
        return (), node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        found = first_path_to(value, kind)
        if found is not None:
            return (key, *found[0]), found[1]
    return None


def parameter_error(errors: list) -> APIError:
    """A 400 for the route's own parameters that FastAPI refused (an upload's form fields, a
    listing's query), named and coded as parse_body names a JSON body's: their locations begin
    with where the value was read (`body`, `query`), which is no part of the client's name for it."""
    first = errors[0]
    param = ".".join(str(part) for part in first["loc"][1:]) or None
    code = error_code(first, "invalid_value")
    return bad_request(f"{param}: {first['msg']}" if param else first["msg"], param, code)


def error_code(error: dict, default: str) -> str:
    """OpenAI's code for a pydantic error: a number past a bound by its kind and side
    (`decimal_above_max_value`), a list or object by its length (`array_above_max_length`), a
    value of another JSON type `invalid_type` (pydantic's `*_type` errors); else ERROR_CODES'
    or `default`."""
    kind = error["type"]
    if kind in BOUNDS:
        return bound_code(BOUNDS[kind], is_decimal_bound(error))
    if kind in ("too_short", "too_long"):
        return length_code(kind == "too_short", error.get("input"))
    if kind.endswith("_type"):
        return "invalid_type"
    return ERROR_CODES.get(kind, default)


def telling(errors: list) -> dict:
    """The error to answer: of a union's members' errors on the first bad field, the one of the
    member the value's type matched (a list of five stops is too long, not "no string"): pydantic's
    errors of a member the value is not of are its `*_type` ones. Else the first."""
    param = param_of(errors[0])
    return next((e for e in errors if param_of(e) == param and not e["type"].endswith("_type")), errors[0])


def param_of(error: dict) -> str | None:
    """The field an error is about, as the client wrote it: `messages.0.content`, without the
    union members and tags that pydantic puts in its path."""
    names: list[str] = []
    path: tuple = ()  # the location so far, as TAGGED_UNIONS keys it
    for part in error["loc"]:
        if path in TAGGED_UNIONS:
            path += (TAGGED_UNIONS[path],)  # `part` is the member's tag
        elif isinstance(part, int) or not UNION_MEMBER.fullmatch(part):
            path += (int if isinstance(part, int) else part,)
            names.append(str(part))
    if error["type"] in ("union_tag_invalid", "union_tag_not_found") and path in TAGGED_UNIONS:
        names.append(TAGGED_UNIONS[path])
    return ".".join(names) or None


def chat_jobs(req: ChatCompletionRequest) -> list[JobSpec]:
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    options = {**sampling(req, max_tokens, logprobs), **chat_options(req)}
    messages = [chat_message(m) for m in req.messages]
    base = JobSpec(messages=messages, priority=req.priority or 0, sampling=options, service_tier=req.service_tier)
    return choices(base, req.choices)


def chat_options(req: ChatCompletionRequest) -> dict[str, Any]:
    """The job's chat options: the tools offered, which must or may be called, the thinking switch."""
    options: dict[str, Any] = {}
    if req.tools:
        options["tools"] = [tool.model_dump(exclude_none=True) for tool in req.tools]
    if req.tool_choice is not None:
        choice = req.tool_choice
        options["tool_choice"] = choice if isinstance(choice, str) else choice.model_dump()
    if req.parallel_tool_calls is not None:
        options["parallel_tool_calls"] = req.parallel_tool_calls
    if req.enable_thinking is not None:
        options["enable_thinking"] = req.enable_thinking
    return options


def completion_jobs(req: CompletionRequest) -> list[JobSpec]:
    if req.best_of is not None and req.best_of != req.choices:
        raise unsupported(
            f"best_of {req.best_of} other than n ({req.choices}) is not supported by this server", "best_of"
        )
    max_tokens = req.max_tokens if req.max_tokens is not None else COMPLETION_MAX_TOKENS
    params = sampling(req, max_tokens, req.logprobs)
    prompts = prompt_list(req.prompt)
    n = req.choices
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts times n={n} exceeds {MAX_CHOICES} choices", "n")
    jobs: list[JobSpec] = []
    for index, prompt in enumerate(prompts):
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        jobs += choices(
            JobSpec(prompt=text, input_ids=ids, priority=req.priority or 0, sampling=params, prompt_index=index), n
        )
    return jobs


def choices(base: JobSpec, n: int) -> list[JobSpec]:
    """n jobs of one prompt. With a seed, choice i samples with seed + i: n jobs of one seed would
    all draw the same tokens, while the same request still gives the same n choices."""
    seed = (base.sampling or {}).get("seed")
    if seed is None or n == 1:
        return [base] * n
    return [replace(base, sampling={**base.sampling, "seed": (seed + i) % SEEDS}) for i in range(n)]


def sampling(req: SamplingRequest, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    params = {name: getattr(req, name) for name in SAMPLING_FIELDS if getattr(req, name) is not None}
    if req.seed is not None:
        params["seed"] = req.seed % SEEDS
    if req.top_p == 0:  # the spec allows it: the smallest nucleus, the most likely token alone
        del params["top_p"]
        params["top_k"] = 1
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    if logprobs is not None:
        params["logprobs"] = logprobs
    if req.stop is not None:
        params["stop"] = [req.stop] if isinstance(req.stop, str) else req.stop
    fmt = structured_output(req)
    if fmt is not None:
        params["response_format"] = fmt
    return params


STRUCTURED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


def structured_output(req: SamplingRequest) -> dict[str, Any] | None:
    """The jobs' response_format, from OpenAI's `response_format` or one of vLLM's guided fields,
    refused with a 400 naming the part the grammar library cannot compile (before any job is
    enqueued)."""
    # response_format `text` is OpenAI's default, no format at all: beside a guided field (as vLLM
    # takes it) that field decides the format; json_object or json_schema beside one conflicts.
    given = [name for name in STRUCTURED_FIELDS if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format.type == "text":
        given.remove("response_format")
    if len(given) > 1:
        raise bad_request(f"give one of {', '.join(STRUCTURED_FIELDS)}, not {' and '.join(given)}", given[1])
    if not given:
        return None
    fmt, at = structured_format(req, given[0])
    try:
        check_format(format_from_json(json.dumps(fmt)), at)
    except InvalidArgument as e:
        raise bad_request(e.message, e.field) from None
    return fmt


def structured_format(req: SamplingRequest, name: str) -> tuple[dict[str, Any], str | None]:
    """(the format, where its schema, pattern or choices sit in the request: None for response_format's own place)."""
    if name == "response_format":
        return req.response_format.model_dump(mode="json", exclude_none=True), None
    if name == "guided_regex":
        return {"type": "regex", "pattern": req.guided_regex}, name
    if name == "guided_choice":
        return {"type": "choice", "choices": req.guided_choice}, name
    schema = req.guided_json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"guided_json: not JSON: {e}", name) from None
    if not isinstance(schema, dict):
        raise bad_request("guided_json: a JSON schema is a JSON object", name)
    return {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": schema}}, name


def chat_message(message) -> dict[str, Any]:
    """A request's message as the job's: text parts joined, OpenAI's `developer` role as the
    `system` the chat template knows, an assistant's refusal as what it said."""
    if isinstance(message, AssistantMessage):
        return assistant_message(message)
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": text_of(message.content),
    }
    if isinstance(message, ToolMessage):
        out["tool_call_id"] = message.tool_call_id
    return out


def assistant_message(message: AssistantMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = "".join(p.text if isinstance(p, TextPart) else p.refusal for p in content)
    if content is None:
        content = message.refusal if message.refusal is not None or not message.tool_calls else None
    out: dict[str, Any] = {"role": "assistant", "content": content or ("" if not message.tool_calls else None)}
    if message.tool_calls:
        out["tool_calls"] = [call.model_dump(exclude={"index"}) for call in message.tool_calls]
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    return out


def text_of(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """A completion's prompts: a string, strings, token ids, or lists of token ids."""
    if isinstance(prompt, str) or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
