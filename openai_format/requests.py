"""OpenAI's requests: its chat and text completions as its published OpenAPI spec states them
(fields, bounds, nullability), with vLLM's extras. The response objects are in
openai_format.responses.

Requests are parsed strictly from JSON. A field sent as null means its default, as the SDKs send
it. A parameter of the spec that MILI cannot honour is accepted at its default (`echo: false`,
`logit_bias: {}`) and refused with a 400 naming it otherwise; a parameter the spec does not know
is refused too, so that nothing a client asks for is silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    field_validator,
)
from pydantic_core import PydanticCustomError

from producer_client import structured
from producer_client.chat import MAX_TOOLS, NamedToolChoice, Tool, ToolCall
from producer_client.structured import JsonObjectFormat, JsonSchemaFormat

MAX_CHOICES = 128  # jobs one request may create: n, times the prompts of a completion (the spec's bound on n)
MAX_STOP = 4  # the spec's bound on stop sequences
INT64 = 2**63

NonEmptyIds = Annotated[list[int], Field(min_length=1)]
# A text completion's prompt where the request's is null or empty: the spec's default, the token
# that begins a document for OpenAI's models and Qwen3's alike (it has no BOS token).
DOCUMENT_START = "<|endoftext|>"
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512  # the spec's Metadata bounds


def within_metadata_bounds(metadata: dict[str, str]) -> dict[str, str]:
    """The spec's bounds on a key and a value, checked here rather than as constrained dict keys,
    whose error would name the field by the (long) key itself."""
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise PydanticCustomError("string_too_long", f"a key is over {METADATA_KEY_CHARS} characters")
        if len(value) > METADATA_VALUE_CHARS:
            raise PydanticCustomError(
                "string_too_long", f"the value of {key!r} is over {METADATA_VALUE_CHARS} characters"
            )
    return metadata


# OpenAI's Metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512.
Metadata = Annotated[dict[str, str], Field(max_length=METADATA_PAIRS), AfterValidator(within_metadata_bounds)]


class Unsupported(ValueError):
    """A parameter of the spec that MILI cannot honour, given other than at its default."""


def only(*defaults: Any):
    """A field MILI accepts only at its defaults (null is always one)."""

    allowed = " or ".join([*map(repr_json, defaults), "null"])

    def check(value: Any) -> Any:
        if value is not None and value not in defaults:
            raise Unsupported(f"is not supported by this server: only {allowed}")
        return value

    return AfterValidator(check)


def repr_json(value: Any) -> str:
    return {False: "false", True: "true"}.get(value, repr(value)) if isinstance(value, bool) else repr(value)


Unused = Annotated[Any, only()]  # in the spec, not in MILI: null only

# OpenAI's service_tier values: those MILI runs (producer_client.new_job.SERVICE_TIERS, a lane
# each; `fast`, as the spec's ServiceTier says, is `priority` asked by another name, and answered
# as `priority`) and the one it does not (unsupported_parameter).
RUN_TIERS = ("auto", "default", "flex", "priority", "fast")
OTHER_TIERS = ("scale",)
SAME_TIER = {"fast": "priority"}


def a_spec_tier(value: Any) -> Any:
    """A service_tier that is none of the spec's is an invalid value whose message lists the tiers
    MILI takes: the Literal's own error listed "scale" and "fast" as valid, which only() then
    refuses as unsupported."""
    if value is not None and value not in RUN_TIERS + OTHER_TIERS:
        expected = ", ".join(map(repr, RUN_TIERS[:-1])) + f" or {RUN_TIERS[-1]!r}"
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})
    return value


def as_run_tier(value: str | None) -> str | None:
    return SAME_TIER.get(value, value)


class Strict(BaseModel):
    # A NaN or an infinity (JSON has neither, but Python's json and pydantic read them) is no
    # finite number: refused as such, not for whichever bound a NaN happened to fail.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # there is no obfuscation field to leave out


class TextFormat(Strict):
    type: Literal["text"]


# OpenAI's response_format: plain text (the default), any JSON object, or a JSON schema.
ResponseFormatIn = Annotated[TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")]


class SamplingRequest(Strict):
    """What chat and text completions share. Sampling fields map one to one onto the client's
    SamplingParams, which checks what the spec leaves open (see openai_format.job_specs)."""

    model: str
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    max_tokens: int | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)  # float bounds: a decimal's codes (bound_code)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stop: str | Annotated[list[str], Field(min_length=1, max_length=MAX_STOP)] | None = None
    seed: int | None = Field(None, ge=-INT64, lt=INT64)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, int] | None, only({})] = None
    user: str | None = None  # accepted and logged; it steers nothing
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    # vLLM's extras, in the body as vLLM takes them.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    priority: int | None = None
    # Structured outputs, as OpenAI asks for them (text completions take them too, as in vLLM),
    # and vLLM's guided decoding: a JSON schema (or its JSON text), a regex, one of the choices.
    response_format: ResponseFormatIn | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1, max_length=structured.MAX_PATTERN_CHARS)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=structured.MAX_CHOICES
    )

    @property
    def streams(self) -> bool:
        return bool(self.stream)

    @property
    def choices(self) -> int:
        return self.n or 1


# -- chat messages, as the spec's request message types ---------------------------------------------


class PromptCacheBreakpoint(Strict):
    """The spec's explicit cache breakpoint on a part: accepted, with no effect, as
    prompt_cache_key is (the radix cache finds shared prefixes by itself)."""

    mode: Literal["explicit"]


class PromptCacheOptions(Strict):
    """The spec's prompt_cache_options: accepted, with no effect, as PromptCacheBreakpoint."""

    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


TextContent = str | Annotated[list[TextPart], Field(min_length=1)]


class SystemMessage(Strict):
    role: Literal["system", "developer"]
    content: TextContent
    name: str | None = None  # accepted; the chat template does not use it


MEDIA_PARTS = ("image_url", "input_audio", "file")  # the spec's user content parts that are not text


class UserMessage(Strict):
    role: Literal["user"]
    content: TextContent
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content: Any) -> Any:
        """Images, audio and files are refused by name, before the union's checks would say
        only that the content is not a string."""
        if isinstance(content, list):
            for index, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in MEDIA_PARTS:
                    raise Unsupported(
                        f"part {index} is of type {kind}, which MILI does not support: it serves text only "
                        "(send a string or text parts)"
                    )
        return content


def refusing_types(spec_types: frozenset[str], instead: str):
    """An object of a `type` the spec has but MILI cannot honour (a custom tool, a custom call in
    history, an allowed_tools choice) refused as such, an unsupported_parameter, not as a shape
    the spec has not."""

    def check(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind in spec_types:
            raise Unsupported(f"of type {kind!r} is not supported by this server: {instead}")
        return value

    return BeforeValidator(check)


class ToolCallIn(ToolCall):
    """A call in history. The SDK's stream helper leaves each call's stream `index` on the
    message it assembles, and agents send that message back as it is: accepted, and unused."""

    index: int | None = None


class AssistantMessage(Strict):
    """As the SDK returns it, sent back as history: `refusal`, `annotations`, `audio` and
    `function_call` come along as null; `reasoning_content` (vLLM's field, which the SDK keeps)
    is rendered as the template says."""

    role: Literal["assistant"]
    content: str | Annotated[list[TextPart | RefusalPart], Field(min_length=1)] | None = None
    refusal: str | None = None
    name: str | None = None
    tool_calls: list[Annotated[ToolCallIn, refusing_types(frozenset({"custom"}), "only function calls")]] | None = None
    reasoning_content: str | None = None
    annotations: list[dict] | None = None  # a response's citations, sent back: nothing to render
    audio: Unused = None
    function_call: Unused = None


class ToolMessage(Strict):
    role: Literal["tool"]
    content: TextContent
    tool_call_id: str


def refused(why: str):
    """A value of the spec's that MILI refuses whatever else the request says."""

    def check(value: Any) -> Any:
        raise Unsupported(why)

    return AfterValidator(check)


class FunctionMessage(Strict):
    """The spec's deprecated function message, the answer to a call of `functions`, which MILI
    does not support either: refused as such (an unsupported_parameter naming its role), not as
    a role the spec does not have."""

    role: Annotated[Literal["function"], refused("function is not supported by this server: use tools")]
    content: str | None = None
    name: str


def message_tag(role: Any) -> Any:
    """A message's member of ChatMessageIn, by its role: of a JSON object's, to validate it, and of
    a message's, to serialize it (a request's fingerprint, gateway/idempotency.py). Read of a
    dict only, the tag of every message serialized was None: pydantic then tried each member in
    turn and warned for each, 0.8 s of warnings on the event loop for 140,000 messages."""
    return {"developer": "system"}.get(role, role)


ChatMessageIn = Annotated[
    Annotated[SystemMessage, Tag("system")]
    | Annotated[UserMessage, Tag("user")]
    | Annotated[AssistantMessage, Tag("assistant")]
    | Annotated[ToolMessage, Tag("tool")]
    | Annotated[FunctionMessage, Tag("function")],
    Discriminator(lambda m: message_tag(m.get("role") if isinstance(m, dict) else getattr(m, "role", None))),
]


class ChatTemplateKwargs(Strict):
    """vLLM's `chat_template_kwargs`: of Qwen3's template, its thinking switch."""

    enable_thinking: bool | None = None


ToolIn = Annotated[Tool, refusing_types(frozenset({"custom"}), "only function tools")]
ToolChoiceIn = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice | None,
    refusing_types(frozenset({"custom", "allowed_tools"}), "none, auto, required or one function"),
]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[ToolIn] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoiceIn = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    # The job's lane (producer_client.new_job.SERVICE_TIERS; `fast` read as `priority`): OpenAI's
    # "scale" is not MILI's (unsupported_parameter); a value the spec has not is no service tier
    # (invalid_value).
    service_tier: Annotated[
        Literal["auto", "default", "flex", "scale", "priority", "fast"] | None,
        BeforeValidator(a_spec_tier),
        only(*RUN_TIERS),
        AfterValidator(as_run_tier),
    ] = None
    # Accepted as the spec describes them, with no effect on the output.
    metadata: Metadata | None = None
    store: Annotated[bool | None, only(False)] = None
    prompt_cache_key: str | None = None  # a cache hint: the radix cache finds shared prefixes by itself
    prompt_cache_options: PromptCacheOptions | None = None
    safety_identifier: str | None = Field(None, max_length=64)
    modalities: Annotated[list[str] | None, only(["text"])] = None
    audio: Unused = None
    prediction: Unused = None
    reasoning_effort: Unused = None
    verbosity: Annotated[Any, only("medium")] = None  # the spec's default: no length asked for
    web_search_options: Unused = None
    moderation: Unused = None
    # The spec's "in_memory" (its other value, "24h", keeps prefixes up to a day: extended caching)
    # is what the radix cache does: prefixes held in device memory while it has room for them.
    prompt_cache_retention: Annotated[Any, only("in_memory")] = None
    functions: Unused = None
    function_call: Unused = None

    @property
    def enable_thinking(self) -> bool | None:
        return None if self.chat_template_kwargs is None else self.chat_template_kwargs.enable_thinking


class CompletionRequest(SamplingRequest):
    prompt: (
        str
        | Annotated[list[str], Field(min_length=1)]
        | NonEmptyIds
        | Annotated[list[NonEmptyIds], Field(min_length=1)]
    )
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: Annotated[bool | None, only(False)] = None
    suffix: Annotated[str | None, only("")] = None
    best_of: int | None = Field(None, ge=0, le=20)  # only as n: one sample per choice (job_specs)

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _one_prompt_form(cls, value, handler):
        # One message instead of one per member of the union. A list is validated as the form its
        # first item names: the union tried every member over every item, holding the GIL (and
        # so every other request) 0.7 s for 2,000,000 token ids, where one member takes 0.04 s.
        if value is None or value == "":
            return DOCUMENT_START
        form = PROMPT_FORMS.get(type(value[0])) if isinstance(value, list) and value else None
        try:
            prompt = handler(value) if form is None else form.validate_python(value, strict=True)
        except ValidationError:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of such lists"
            ) from None
        return [p or DOCUMENT_START for p in prompt] if form is PROMPT_FORMS[str] else prompt


# A completion's prompt list by the type of its first item (CompletionRequest._one_prompt_form).
PROMPT_FORMS = {
    str: TypeAdapter(list[str]),
    int: TypeAdapter(NonEmptyIds),
    list: TypeAdapter(list[NonEmptyIds]),
}
