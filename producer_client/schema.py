"""Wire models shared by the client and the worker (pydantic only: no torch here)."""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from producer_client.chat import MAX_TOOLS, ChatMessage, NamedToolChoice, Tool, ToolCall, ToolChoice, tool_names
from producer_client.errors import (
    BodyTooLarge,
    InvalidArgument,
    InvalidBody,
    InvalidJob,
    MiliError,
    OutOfRange,
    TooLong,
)
from producer_client.keys import NAME_PATTERN
from producer_client.structured import FORMAT_TYPES, ResponseFormat

# Fields read from `__dict__`: pydantic's BaseModel defines __getattr__ (for private attributes),
# so CPython 3.11 cannot specialize an attribute read of a model's instance: each read of a field
# is about 400 instructions, a read of its `__dict__`'s item a tenth of that. The checks a submit
# runs on every job read their fields from `__dict__` (where pydantic keeps them, model_construct's
# too): some twenty reads a submit (bench/RESULTS.md, "A submit's own work, by instructions (y/submit3)").
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_LOGPROBS = 20
# Token ids and top_k are bounded where they enter (int32, beyond any vocabulary), so that no
# number a producer sends overflows a tensor inside an engine step.
MAX_TOKEN_ID = 2**31
# pydantic names the member of a union it tried in an error's location (`content.str`,
# `tool_choice.literal['none','auto','required']`): a type, where fields are snake_case.
# pydantic's errors of a bound, each with whether the value is below it.
BOUNDS = {"greater_than_equal": True, "greater_than": True, "less_than_equal": False, "less_than": False}
UNION_MEMBER = re.compile(r"str|int|float|bool|[a-z-]+\[.*\]|[A-Z]\w*")


class SamplingParams(BaseModel):
    """Sampling parameters with the names users know from OpenAI and vLLM. `response_format`
    constrains the output to a JSON schema, any JSON object, a regex or a list of choices
    (producer_client.structured), enforced while decoding."""

    # A NaN fails every comparison: it was refused for whichever bound came first ("temperature:
    # Input should be less than or equal to 100"); a number must be finite.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    max_tokens: int = Field(256, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, lt=MAX_TOKEN_ID)  # 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    speculative: bool = True  # False: the job opts out of a worker's speculative decoding

    def __eq__(self, other: object) -> bool:
        # pydantic's, for two of this model, which has no private or extra attributes: a job's body
        # (exclude_defaults) compares its params with the default ones, a Python call per submit.
        if type(other) is SamplingParams:
            return self.__dict__ == other.__dict__
        return super().__eq__(other)

    @classmethod
    def parse(cls, **kwargs: Any) -> SamplingParams:
        """Build and validate, raising InvalidArgument that names the first bad field."""
        try:
            params = cls(**kwargs)
        except ValidationError as e:
            raise invalid_argument_from(e) from None
        params.check_consistency()
        return params

    def check_within(self, max_tokens_limit: int) -> None:
        """The rules of these params a field-by-field schema cannot state, max_tokens within the
        limit first (JobRequest.check: once per submit, and per job a worker reads)."""
        max_tokens = self.__dict__["max_tokens"]  # see the module's note on fields read from `__dict__`
        if max_tokens > max_tokens_limit:
            message = f"{max_tokens} exceeds the limit of {max_tokens_limit}"
            raise OutOfRange("max_tokens", message, below=False)
        self.check_consistency()

    def check_consistency(self) -> None:
        fields = self.__dict__  # see the module's note on fields read from `__dict__`
        if fields["min_tokens"] > fields["max_tokens"]:
            raise InvalidArgument("min_tokens", "must not exceed max_tokens")
        stop = fields["stop"]
        for s in stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                error = TooLong if s else InvalidArgument
                raise error("stop", f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters")
        check_token_ids("stop_token_ids", fields["stop_token_ids"])
        if fields["response_format"] is not None and stop:
            # A stop string is cut from the text, and the cut would break the structure.
            raise InvalidArgument("stop", "cannot be combined with response_format: stop strings cut the output")


def check_token_ids(field: str, token_ids: list[int]) -> None:
    if token_ids and not 0 <= min(token_ids) <= max(token_ids) < MAX_TOKEN_ID:
        raise InvalidArgument(field, f"token ids must be 0 to {MAX_TOKEN_ID - 1}")


def is_decimal_bound(error: Any) -> bool:
    """Whether a bound's pydantic error is of a decimal (a float field's: its bounds are floats)
    rather than an integer: OpenAI's codes tell the two apart (decimal_above_max_value)."""
    return any(isinstance(bound, float) for bound in error.get("ctx", {}).values()) or isinstance(
        error.get("input"), float
    )


def invalid_argument_from(error: ValidationError, strip: str = "") -> InvalidArgument:
    """The first error, its field named as users write it (`max_tokens`, not `params.max_tokens`;
    `response_format.pattern`, not the union member's tag or type pydantic puts in its path)."""
    first = error.errors()[0]
    loc = list(first["loc"])
    for i in range(len(loc) - 1):
        if loc[i] == "response_format" and loc[i + 1] in FORMAT_TYPES:
            del loc[i + 1]
            break
    names = [str(p) for p in loc if isinstance(p, int) or not UNION_MEMBER.fullmatch(p)]
    if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        names.append("type")  # response_format's: the requests' one tagged union
    field = ".".join(names).removeprefix(strip) or "body"
    if first["type"] in BOUNDS:
        return OutOfRange(field, first["msg"], below=BOUNDS[first["type"]], decimal=is_decimal_bound(first))
    if first["type"] == "string_too_long":
        return TooLong(field, first["msg"])
    return InvalidArgument(field, first["msg"])


# ---------------------------------------------------------------------------------------------
# Protocol wire models (v2, keys.PROTOCOL_VERSION). A queue entry is {id, v, body}; `body` is a JobRequest as JSON.

MAX_BODY_BYTES = 1 << 20
MAX_TOKENS_LIMIT = 32768
CHAT_OPTIONS = ("tools", "tool_choice", "parallel_tool_calls", "enable_thinking")  # JobRequest's, for messages only
JOB_OPTIONS = (*CHAT_OPTIONS, "adapter")  # JobRequest's fields a submit takes among the sampling parameters
JobState = Literal["queued", "running", "done", "failed", "cancelled", "expired"]


class JobRequest(BaseModel):
    """What a producer asks for: exactly one of prompt, messages or input_ids, and how to sample.

    `timeout_s` counts from the moment the job entered the queue (its stream entry id), on
    the Redis clock, so producer and worker clocks never need to agree.
    `priority` orders jobs a worker has admitted (lower runs sooner, as in vLLM); the queue
    itself is FIFO.
    `stream`: someone reads the tokens as they come (`stream()`, an SSE response), so the worker
    publishes them within its `stream_interval_s`; otherwise it records them every
    `checkpoint_interval_s` (and sooner once a reader of `stream()` shows up).

    A chat (`messages`) may offer `tools` to the model, rendered by the chat template; with
    `tool_choice` "none" they are neither rendered nor parsed, a named one is the only one offered,
    and `parallel_tool_calls` false ends the output at its first call. `enable_thinking` is the
    chat template's switch of Qwen3's reasoning.

    `adapter` names the LoRA adapter the job runs with, one its queue's workers serve (None: the
    base model). Its prefix cache is the adapter's own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)  # timeout_s: as SamplingParams

    prompt: str | None = Field(None, min_length=1)
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    input_ids: list[int] | None = Field(None, min_length=1)
    params: SamplingParams = SamplingParams()
    priority: int = Field(0, ge=-1000, le=1000)
    timeout_s: float | None = Field(None, gt=0.0, le=7 * 24 * 3600.0)
    stream: bool = False
    tools: list[Tool] | None = Field(None, min_length=1, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool = True
    enable_thinking: bool = True
    adapter: str | None = Field(None, pattern=f"^{NAME_PATTERN.pattern}$")

    @classmethod
    def from_json(cls, body: str | bytes, max_body_bytes: int, max_tokens_limit: int) -> JobRequest:
        """Validate a queue entry's body exactly as strictly as the client validated it."""
        size = len(body.encode() if isinstance(body, str) else body)
        if size > max_body_bytes:
            raise BodyTooLarge("body", f"{size} bytes exceeds the limit of {max_body_bytes}")
        try:
            # model_validate_json's own work, without its wrapper's argument checks: once per job.
            request: JobRequest = cls.__pydantic_validator__.validate_json(body, strict=True)
        except ValidationError as e:
            first = e.errors()[0]
            # Not a JSON object at all: the body is bad. A nested object of the wrong type
            # (`params: []`) is a bad argument, named like any other.
            if first["type"] in ("json_invalid", "json_type") or not first["loc"]:
                raise InvalidBody(f"body is not a JSON object of a job: {first['msg']}") from None
            raise invalid_argument_from(e, strip="params.") from None
        request.check(max_tokens_limit)
        return request

    def check(self, max_tokens_limit: int) -> None:
        """The rules a field-by-field schema cannot state (once per submit, and per job a worker reads)."""
        fields = self.__dict__  # see the module's note on fields read from `__dict__`
        input_ids = fields["input_ids"]
        if (fields["prompt"] is not None) + (fields["messages"] is not None) + (input_ids is not None) != 1:
            raise InvalidArgument("prompt", "give exactly one of prompt, messages or input_ids")
        if input_ids is not None:
            check_token_ids("input_ids", input_ids)
        fields["params"].check_within(max_tokens_limit)
        self.check_chat_options()

    def check_chat_options(self) -> None:
        fields = self.__dict__  # see the module's note on fields read from `__dict__`
        if fields["messages"] is None:
            # Given at all, at any value but None, not only at a value other than its default:
            # enable_thinking=True on a prompt passed where False was refused.
            given = self.__pydantic_fields_set__
            for name in CHAT_OPTIONS:
                if name in given and fields[name] is not None:
                    raise InvalidArgument(name, "applies to chats only (messages)")
            return
        names = tool_names(self.tools or [])
        if len(set(names)) != len(names):
            raise InvalidArgument("tools", "function names must be unique")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise InvalidArgument("tool_choice", "a tool must be called, but no tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidArgument("tool_choice", f"names {choice.function.name!r}, which is not among the tools")

    def offered_tools(self) -> list[Tool]:
        """The tools the model is told about, and whose calls are parsed from its output."""
        if not self.tools or self.tool_choice == "none":
            return []
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == self.tool_choice.function.name]
        return list(self.tools)

    @classmethod
    def strictly_validated(cls, data: dict[str, Any]) -> JobRequest:
        """model_validate(data, strict=True), without the wrapper's argument checks: once per submit."""
        request: JobRequest = cls.__pydantic_validator__.validate_python(data, strict=True)  # pydantic types it Any
        return request

    def to_json(self) -> str:
        """The job's body: model_dump_json(exclude_defaults=True)'s text, a body per submit. That of a
        prompt whose every other field but its params is at its default (nearly every submit's) is
        joined from the prompt's JSON string and its params' JSON, kept per params (params_json):
        the same text, for about a quarter of the instructions of pydantic's serializer, which
        compares each field of the two models with its default at every call."""
        fields = self.__dict__  # see the module's note on fields read from `__dict__`
        prompt = fields["prompt"]
        if prompt is None:
            return self.__pydantic_serializer__.to_json(self, exclude_defaults=True).decode()
        for name, default in PROMPT_JOB_DEFAULTS.items():  # a loop: a generator would be a frame more
            if fields[name] != default:
                return self.__pydantic_serializer__.to_json(self, exclude_defaults=True).decode()
        return prompt_job_body(prompt, fields["params"])


def prompt_job_body(prompt: str, params: SamplingParams) -> str:
    """The body of a job of `prompt` and `params` whose every other field is at its default, as
    JobRequest.to_json joins it: the prompt's JSON string and its params' JSON (params_json)."""
    text, params_text = pydantic_core.to_json(prompt).decode(), params_json(params)
    return f'{{"prompt":{text}}}' if params_text is None else f'{{"prompt":{text},"params":{params_text}}}'


# JobRequest's fields beside its prompt and params, with their defaults: a prompt's job whose fields
# all hold these has the body JobRequest.to_json joins. Every field of JobRequest has a plain default.
# Read once: JobRequest.model_fields is a class property, two Python calls at each read.
PROMPT_JOB_DEFAULTS = {
    name: field.default for name, field in JobRequest.model_fields.items() if name not in ("prompt", "params")
}
DEFAULT_PARAMS = SamplingParams()
# Each SamplingParams' JSON in a body, by the params' identity: a client's memo (new_job.
# sampling_params) hands the same params to every submit that shares them. The params are kept
# beside their JSON, so that no identity is reused while its entry lives; emptied past PARAMS_JSON_KEPT.
_PARAMS_JSON: dict[int, tuple[SamplingParams, str | None]] = {}
PARAMS_JSON_KEPT = 256


def params_json(params: SamplingParams) -> str | None:
    """`params` as a body holds them (exclude_defaults): None for the default ones, which a body
    leaves out. Serialized, and compared with the defaults, once per params."""
    kept = _PARAMS_JSON.get(id(params))
    if kept is not None and kept[0] is params:
        return kept[1]
    text = None
    if params != DEFAULT_PARAMS:
        text = params.__pydantic_serializer__.to_json(params, exclude_defaults=True).decode()
    if len(_PARAMS_JSON) >= PARAMS_JSON_KEPT:
        _PARAMS_JSON.clear()
    _PARAMS_JSON[id(params)] = (params, text)
    return text


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0


class Timings(BaseModel):
    """Epoch seconds. `queued_at` is the stream entry's time (Redis clock); the rest are the worker's."""

    queued_at: float | None = None
    started_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def queue_s(self) -> float | None:
        return _between(self.queued_at, self.started_at)

    @property
    def ttft_s(self) -> float | None:
        return _between(self.queued_at, self.first_token_at)

    @property
    def e2e_s(self) -> float | None:
        return _between(self.queued_at, self.finished_at)


def _between(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else end - start


class ErrorInfo(BaseModel):
    code: str
    message: str


class TokenLogprob(BaseModel):
    """The sampled token's log-probability and the `top` most likely (token id, logprob) pairs."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class JobResult(BaseModel):
    """The final word on a job, written once to its hash and sent as its `end` event. For a chat,
    `text` is the answer, `reasoning` the model's thinking and `tool_calls` the calls it made
    (finish_reason `tool_calls`); `token_ids` are every token it generated."""

    id: str
    status: JobState
    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    token_ids: list[int] = Field(default_factory=list)
    finish_reason: str | None = None
    usage: Usage = Usage()
    timings: Timings = Timings()
    error: ErrorInfo | None = None
    logprobs: list[TokenLogprob] | None = None
    worker: str | None = None


def parse_result(job_id: str, text: str | None) -> JobResult:
    """The job's result as its hash or its `done` entry holds it. One that no worker wrote (a
    producer may write the job's keys) is the job's failure with `invalid_job`, the code a worker
    fails such a job with: it ends that job's wait alone, and every other's goes on."""
    try:
        return JobResult.model_validate_json(text or "")
    except ValidationError:
        return invalid_job_result(InvalidJob(job_id, "its result is not a result's JSON"))


def invalid_job_result(invalid: InvalidJob) -> JobResult:
    """The result a wait over many jobs gives a job whose keys hold what no worker writes: its
    failure with `invalid_job`, the code a worker fails such a job with."""
    return JobResult(id=invalid.job_id, status="failed", error=ErrorInfo(code=invalid.code, message=invalid.message))


class JobFailed(MiliError):
    """The job ended as `failed`; `code` and `message` come from the worker's error."""

    def __init__(self, code: str, message: str, result: JobResult | None = None):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.result = result


class JobExpired(MiliError):
    """The job passed its deadline (`timeout_s`, from its enqueue) before a worker started it: no
    worker will. `result` is the expired result a worker wrote on reading it, if one has."""

    code = "expired"

    def __init__(self, job_id: str, result: JobResult | None = None):
        super().__init__(f"job {job_id} passed its deadline before a worker started it")
        self.job_id = job_id
        self.result = result


class JobStatus(BaseModel):
    id: str
    status: JobState
    tokens: int = 0  # generated so far
    worker: str | None = None
    cancel_requested: bool = False
    result: JobResult | None = None


class TokenDelta(BaseModel):
    """One `tokens` event. Pass `event_id` as `after=` to resume a stream just past it. For a chat,
    `text` is the answer's delta, `reasoning` the thinking's, and `tool_calls` the calls completed
    (each whole: its arguments are known to be JSON only once it closes); the deltas add up to the
    result's `text`, `reasoning` and `tool_calls`."""

    event_id: str
    token_ids: list[int]
    text: str
    reasoning: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None


class StreamStats(BaseModel):
    """One stream of a queue's jobs: a lane's jobs of one tenant (None: of no tenant), or the jobs
    placed on one worker (`worker`; lane and tenant None: each entry names its own)."""

    lane: str | None
    tenant: str | None
    worker: str | None = None
    shard: int = 0  # on a queue of several shards, the shard of a lane's stream
    depth: int
    pending: int
    waiting: int


class QueueStats(BaseModel):
    """The queue's jobs over every stream that holds them (producer_client.protocol.backlog): its
    own stream (the default lane's jobs of no tenant), each lane's of each tenant, and each worker's
    own (the jobs placed on it)."""

    queue: str
    depth: int  # entries not yet acknowledged: waiting + pending
    pending: int  # delivered to a worker, not yet acknowledged
    waiting: int  # not yet delivered to any worker (the group's lag)
    workers: list[str]  # names of workers with a fresh heartbeat
    streams: list[StreamStats] = Field(default_factory=list)  # each stream that holds jobs


class WorkerInfo(BaseModel):
    """A live worker, as its heartbeat hash `mili:worker:{name}` describes it."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    name: str
    queue: str
    model: str  # the worker's --model: a preset name, "echo", or a checkpoint path
    device: str
    state: Literal["serving", "draining"]
    running: int
    free_slots: int
    free_pages: int
    total_pages: int = 0  # the KV pool's size: with free_pages, the worker's KV usage
    started_at: float
    adapters: list[str] = Field(default_factory=list)  # the LoRA adapters it serves (by name)

    @field_validator("adapters", mode="before")
    @classmethod
    def _listed(cls, value: object) -> object:
        """The heartbeat holds them comma-separated (no name has a comma: keys.NAME_PATTERN)."""
        return [name for name in value.split(",") if name] if isinstance(value, str) else value
