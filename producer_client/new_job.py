"""A job as a client builds it, before it is enqueued: every argument validated the way the worker
will, its JSON body, its id (the caller's request_id, or a fresh one), the fingerprint a
request_id is bound to, and the prefix key that places it (producer_client.placement)."""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from pydantic import ValidationError

from producer_client import structured
from producer_client.errors import BodyTooLarge, IdempotencyConflict, InvalidArgument
from producer_client.keys import DEFAULT_LANE, Keys, check_name
from producer_client.placement import prefix_key, prompt_prefix_key
from producer_client.protocol import producer as scripts
from producer_client.protocol.script import ScriptCall
from producer_client.schema import (
    JOB_OPTIONS,
    MAX_BODY_BYTES,
    MAX_TOKENS_LIMIT,
    JobRequest,
    SamplingParams,
    invalid_argument_from,
    prompt_job_body,
)

FINGERPRINT_CHARS = 64
FINGERPRINT = re.compile(r"[A-Za-z0-9]{1,64}")
# OpenAI's service_tier values, and the lane each names (docs/client.md, "Lanes and tenants").
SERVICE_TIERS = {"auto": DEFAULT_LANE, "default": DEFAULT_LANE, "priority": "priority", "flex": "flex"}
CHARS_PER_TOKEN = 4  # OpenAI's rule of thumb for estimating a text's tokens without a tokenizer


# The least a message and a token id take in a job's body: `{"role":"user","content":""},` and `0,`.
MESSAGE_BYTES_AT_LEAST = 29
ID_BYTES_AT_LEAST = 2

# sampling_params' memo: each set of SamplingParams validated, by its arguments' names, types and values.
KnownParams = dict[tuple[tuple[str, type, Any], ...], SamplingParams]
# A memo holds at most this many sets, and starts again empty past them: a client's submits mostly
# share a few, and a caller that varies a float at every submit must not grow it for ever.
KNOWN_PARAMS = 256


class NewJob(NamedTuple):
    """A job built and checked, to enqueue. A tuple, not a frozen dataclass: a third of the time to
    make (submit_many makes tens of thousands), and, holding only strings and numbers, no work for
    the garbage collector once it has seen it."""

    job_id: str
    body: str
    idempotent: bool  # the id came from the caller's request_id, so it may exist already
    timeout_ms: int  # 0: no deadline
    fingerprint: str = ""  # of the request an idempotent job answers: its request_id is bound to it
    prefix: bytes = b""  # what places it (placement.prefix_key)
    adapter: str | None = None  # the LoRA adapter it names (JobRequest.adapter)
    lane: str = DEFAULT_LANE
    cost: int = 0  # its tokens as the lanes and the tokens-per-minute limit count them (estimated_tokens)
    requests: int = 1  # what it counts against a requests-per-minute limit (0: a further choice of one request)
    # What it counts against a tokens-per-minute limit; None: its cost. A request's first job counts
    # every choice's tokens and the further ones none, so that the limit takes or refuses it whole.
    tokens: int | None = None

    def create_call(self, keys: Keys) -> ScriptCall:
        return scripts.create(keys, self.job_id, self.timeout_ms, self.fingerprint)

    def created(self, reply: int) -> bool:
        """CREATE's reply: whether to enqueue the job. Raises IdempotencyConflict when its id is
        another request's."""
        if reply == -1:
            raise IdempotencyConflict(self.job_id)
        return bool(reply)


def build_job(
    prompt: Any,
    messages: Any,
    input_ids: Any,
    request_id: Any,
    timeout_s: Any,
    priority: Any,
    options: dict[str, Any],
    fingerprint: Any = None,
    stream: Any = False,
    service_tier: Any = None,
    known_params: KnownParams | None = None,
    tenant: str | None = None,
) -> NewJob:
    """Validate every argument the way the worker will, before anything touches Redis. `options`
    are SamplingParams' fields and JobRequest's other options (tools, enable_thinking..., adapter). A
    job with a request_id is bound to `fingerprint` (a digest of the request it answers; by
    default of what it generates from): a later submit of the same id with another raises
    IdempotencyConflict. `service_tier` names its lane (SERVICE_TIERS; None: default).
    `known_params`: see sampling_params. `tenant`: the submitting client's (fresh_job_id)."""
    lane = lane_of(service_tier)
    plain = is_plain_prompt(prompt, messages, input_ids, priority, timeout_s, stream, options)
    if plain and request_id is None and fingerprint is None:  # most submits: see plain_prompt_job
        return plain_prompt_job(prompt, options, known_params, tenant, lane)
    if messages is not None or input_ids is not None:  # no call for a prompt's job: submit_many makes many
        check_least_size(messages, input_ids)
    request = validated_request(prompt, messages, input_ids, priority, timeout_s, stream, options, known_params)
    body = checked_body(request.to_json())
    fields = request.__dict__  # not attributes: see schema.py's note on fields read from `__dict__`
    timeout_s, adapter = fields["timeout_s"], fields["adapter"]
    timeout_ms = 0 if timeout_s is None else max(1, round(timeout_s * 1000))
    cost = estimated_tokens(request, body)
    if request_id is None:
        if fingerprint is not None:  # binds nothing here, but a malformed one is still the caller's mistake
            bound_fingerprint(request, fingerprint)
        job_id = fresh_job_id(tenant)
        return NewJob(job_id, body, False, timeout_ms, "", prefix_key(request), adapter, lane, cost)
    fingerprint = bound_fingerprint(request, fingerprint)
    job_id = checked_request_id(request_id, tenant)
    return NewJob(job_id, body, True, timeout_ms, fingerprint, prefix_key(request), adapter, lane, cost)


def is_plain_prompt(
    prompt: Any, messages: Any, input_ids: Any, priority: Any, timeout_s: Any, stream: Any, options: dict[str, Any]
) -> bool:
    """Whether a job is a plain prompt's: a non-empty str, with sampling parameters alone and every
    other field at its default (as given, not only equal to it: priority=False is no int). Its
    JobRequest would hold these as given; JobRequest's schema refuses no such prompt (its one rule
    for a str prompt is min_length=1), and its checks beside the params' cannot fail for it."""
    return (
        type(prompt) is str
        and prompt != ""
        and messages is None
        and input_ids is None
        and type(priority) is int
        and priority == 0
        and timeout_s is None
        and stream is False
        and options.keys().isdisjoint(JOB_OPTIONS)
    )


def plain_prompt_job(
    prompt: str, sampling: dict[str, Any], known_params: KnownParams | None, tenant: str | None, lane: str
) -> NewJob:
    """build_job of a plain prompt's job (is_plain_prompt) with no request_id nor fingerprint: the
    same checks, in the same order (its params', then its body's size), and the same job, without
    the JobRequest, whose validation, field reads and checks were about a fifth of a submit's
    instructions (bench/RESULTS.md, "A plain prompt's job built without its JobRequest")."""
    try:
        params = sampling_params(sampling, known_params)
    except ValidationError as e:
        raise invalid_argument_from(e, strip="params.") from None
    params.check_within(MAX_TOKENS_LIMIT)
    check_format_of(params)
    body = checked_body(prompt_job_body(prompt, params))
    cost = -(-len(prompt) // CHARS_PER_TOKEN) + params.__dict__["max_tokens"]  # estimated_tokens
    return NewJob(fresh_job_id(tenant), body, False, 0, "", prompt_prefix_key(prompt), None, lane, cost)


def checked_body(body: str) -> str:
    """`body`, refused (BodyTooLarge) past MAX_BODY_BYTES."""
    size = len(body.encode())
    if size > MAX_BODY_BYTES:
        raise BodyTooLarge("body", f"{size} bytes exceeds the limit of {MAX_BODY_BYTES}")
    return body


def check_least_size(messages: Any, input_ids: Any) -> None:
    """Refuses, before they are validated, messages or token ids too many for any job's body to
    hold: 140,000 messages took 0.5 s to validate only for their body to be refused."""
    count = len(messages) if isinstance(messages, list) else len(input_ids) if isinstance(input_ids, list) else 0
    least = count * (MESSAGE_BYTES_AT_LEAST if isinstance(messages, list) else ID_BYTES_AT_LEAST)
    if least > MAX_BODY_BYTES:
        what = "messages" if isinstance(messages, list) else "token ids"
        raise BodyTooLarge("body", f"{count} {what} take at least {least} bytes, over the limit of {MAX_BODY_BYTES}")


def checked_request_id(request_id: Any, tenant: str | None) -> str:
    """The caller's request_id as the job's id, refused (InvalidArgument) where it names a tenant
    not the client's: a job's tenant is its id's up to the first '.' (fresh_job_id), and
    `team-a.x` from a client of no tenant or of team-b would be team-a's job to the gateway's key
    and to a Redis user pinned to team-a, while its lanes, quota and limits charged another. An
    id without a '.' is no tenant's, as an open gateway's Idempotency-Keys are (gateway/idempotency.py)."""
    job_id = check_name("request_id", request_id)
    named, dot, _ = job_id.partition(".")
    if dot and named != tenant:
        own = "hold no '.'" if tenant is None else f"begin with {tenant + '.'!r} or hold no '.'"
        raise InvalidArgument(
            "request_id",
            f"{job_id!r} names tenant {named!r} (a job's tenant is its id's up to the first '.'), "
            f"and this client submits as {'no tenant' if tenant is None else f'tenant {tenant!r}'}: it must {own}",
        )
    return job_id


def fresh_job_id(tenant: str | None) -> str:
    """A job id nobody chose: 128 random bits, as a uuid4's hex without building the UUID
    (submit_many makes many), after `<tenant>.` for a tenant's job. The id is where a job's tenant
    is recorded: it costs the job's keys no field, survives every rewrite of its hash (a job's
    end, a retry), and the gateway tells an API key's jobs by it (gateway.api_keys.Tenant.owns_job)."""
    random_hex = os.urandom(16).hex()
    return random_hex if tenant is None else f"{tenant}.{random_hex}"


def validated_request(
    prompt: Any,
    messages: Any,
    input_ids: Any,
    priority: Any,
    timeout_s: Any,
    stream: Any,
    options: dict[str, Any],
    known_params: KnownParams | None = None,
) -> JobRequest:
    """The JobRequest of the arguments, validated once (the schema, then the rules it cannot state,
    then the grammars it names); InvalidArgument names the first bad one."""
    if options.keys().isdisjoint(JOB_OPTIONS):  # sampling parameters alone: the most common by far
        sampling, chat = options, {}
    else:
        sampling = {k: v for k, v in options.items() if k not in JOB_OPTIONS}
        chat = {k: v for k, v in options.items() if k in JOB_OPTIONS}
    try:
        params = sampling_params(sampling, known_params)
        request = JobRequest.strictly_validated(
            {
                "prompt": prompt,
                "messages": messages,
                "input_ids": input_ids,
                "params": params,
                "priority": priority,
                "timeout_s": timeout_s,
                "stream": stream,
                **chat,
            },
        )
    except ValidationError as e:
        raise invalid_argument_from(e, strip="params.") from None
    request.check(MAX_TOKENS_LIMIT)
    check_grammars(request)
    return request


def sampling_params(sampling: dict[str, Any], known: KnownParams | None) -> SamplingParams:
    """SamplingParams of `sampling`, validated. `known`: a memo of those validated already, by their
    arguments' names, types and values (a client's, and submit_many's: jobs mostly share theirs,
    and a lookup costs a fifth of a validation; SamplingParams is frozen, so jobs may share one);
    arguments that are not all hashable are validated."""
    if known is None:
        return SamplingParams.model_validate(sampling, strict=True)
    try:
        # (name, type, value) of each, by zip and map: a comprehension would be a frame of its own.
        key = tuple(zip(sampling, map(type, sampling.values()), sampling.values()))
        params = known.get(key)
    except TypeError:  # a list (stop, stop_token_ids) or a dict (response_format)
        return SamplingParams.model_validate(sampling, strict=True)
    if params is None:
        params = SamplingParams.model_validate(sampling, strict=True)
        if len(known) >= KNOWN_PARAMS:
            known.clear()
        known[key] = params
    return params


def bound_fingerprint(request: JobRequest, fingerprint: Any) -> str:
    """What a request_id is bound to: the caller's digest, checked, or that of the request's generation."""
    if fingerprint is None:
        return generation_fingerprint(request)
    if not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint):
        raise InvalidArgument("request_fingerprint", f"must be 1-{FINGERPRINT_CHARS} letters and digits")
    return fingerprint


def lane_of(service_tier: Any) -> str:
    """The lane OpenAI's `service_tier` value names: auto and default the default lane."""
    if service_tier is None:
        return DEFAULT_LANE
    if not isinstance(service_tier, str) or service_tier not in SERVICE_TIERS:
        raise InvalidArgument("service_tier", f"must be one of {', '.join(SERVICE_TIERS)}")
    return SERVICE_TIERS[service_tier]


def estimated_tokens(request: JobRequest, body: str) -> int:
    """A job's tokens as OpenAI counts them against a tokens-per-minute limit, without a
    tokenizer: its prompt's (the ids' count, else about one per CHARS_PER_TOKEN characters of the
    prompt, or of the body for a chat) plus max_tokens."""
    fields = request.__dict__  # see schema.py's note on fields read from `__dict__`
    input_ids, text = fields["input_ids"], fields["prompt"]
    if input_ids is not None:
        prompt = len(input_ids)
    else:
        prompt = -(-len(text if text is not None else body) // CHARS_PER_TOKEN)
    max_tokens: int = fields["params"].__dict__["max_tokens"]
    return prompt + max_tokens


def build_job_of(
    arguments: Mapping[str, Any],
    requests: int = 1,
    known_params: KnownParams | None = None,
    tenant: str | None = None,
    tokens: int | None = None,
) -> NewJob:
    """build_job() of submit()'s keyword arguments, given as a dict; `requests` and `tokens`: what
    the job counts against a requests- and a tokens-per-minute limit (NewJob.requests, .tokens);
    `known_params`: see sampling_params; `tenant`: the submitting client's (fresh_job_id)."""
    options = dict(arguments)
    fingerprint, stream = options.pop("request_fingerprint", None), options.pop("stream", False)
    job = build_job(
        options.pop("prompt", None),
        options.pop("messages", None),
        options.pop("input_ids", None),
        options.pop("request_id", None),
        options.pop("timeout_s", None),
        options.pop("priority", 0),
        options,
        fingerprint,
        stream=stream,
        service_tier=options.pop("service_tier", None),
        known_params=known_params,
        tenant=tenant,
    )
    return job if requests == 1 and tokens is None else job._replace(requests=requests, tokens=tokens)


def generation_fingerprint(request: JobRequest) -> str:
    """A digest of what a job generates from: its prompt, sampling parameters and chat options.
    Not its deadline or priority: a retry may count its deadline from its own start; nor whether
    it is streamed: a retry may read the same job whole."""
    generation = request.model_dump_json(exclude={"timeout_s", "priority", "stream"})
    return hashlib.sha256(generation.encode()).hexdigest()


# A job of this many messages, or token ids, takes about a millisecond to build (1.7 us a message,
# 0.07 us an id); text costs little beside them (2.8 ms a MiB, and a job's body is 1 MiB at most).
LONG_JOB_MESSAGES = 512
LONG_JOB_IDS = 16384


def check_format_of(
    params: SamplingParams, check: Callable[..., None] = structured.check_format
) -> structured.ResponseFormat | None:
    """The params' response_format, refused (by `check`: see check_grammars) where the worker could
    not compile it."""
    fmt: structured.ResponseFormat | None = params.__dict__["response_format"]
    if fmt is not None:
        check(fmt)
    return fmt


def builds_long(arguments: Mapping[str, Any]) -> bool:
    """Whether submit()'s keyword arguments take more than about a millisecond to validate and
    serialize: many messages, or many token ids (a 1 MiB job of 33,000 messages takes 130 ms). Read
    before validation, so loosely: a caller that must not block (AsyncClient) builds such a job off
    its event loop."""
    messages, input_ids = arguments.get("messages"), arguments.get("input_ids")
    return (isinstance(messages, list) and len(messages) >= LONG_JOB_MESSAGES) or (
        isinstance(input_ids, list) and len(input_ids) >= LONG_JOB_IDS
    )


def asks_for_grammar(arguments: Mapping[str, Any]) -> bool:
    """Whether submit()'s keyword arguments name what check_grammars compiles: a response_format, or
    tools (compiled where a call is enforced). Read before validation, so loosely: a caller that
    must not block on a compile (AsyncClient) validates such a job off its event loop."""
    return arguments.get("response_format") is not None or bool(arguments.get("tools"))


def check_grammars(request: JobRequest, check: Callable[..., None] = structured.check_format) -> None:
    """Refuses, before anything is enqueued, what the worker would hold the output to and could not
    compile: the response_format, and the tools' parameters where a call is enforced (a forced
    tool_choice, or tools beside a response_format). `check`: structured.check_format, or the
    worker's structured.check_size."""
    fields = request.__dict__  # see schema.py's note on fields read from `__dict__`
    fmt = check_format_of(fields["params"], check)
    forced = fields["tool_choice"] not in (None, "auto", "none")
    if forced or fmt is not None:
        for i, tool in enumerate(request.tools or []):
            if tool.function.parameters is not None and tool in request.offered_tools():
                check(structured.schema_format(tool.function.parameters), f"tools.{i}.function.parameters")
