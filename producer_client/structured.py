"""Structured outputs on the wire: what a job's output must match (`response_format`), and the
check that refuses, before anything is enqueued, a schema, pattern or choice list the grammar
library cannot compile or does not support.

The grammar library is llguidance (bench/RESULTS.md says why): a 3 MB wheel with no
dependencies, no torch. The plain client installs without it; it is the `structured` extra (the
worker and the gateway extras include it), imported only when a job asks for a format. The
check compiles the grammar in full, over a byte vocabulary: unsupported keywords, bad regexes,
dangling `$ref`s and unsatisfiable schemas are refused here as the worker would refuse them.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from producer_client import regex_size
from producer_client.errors import InvalidArgument

if TYPE_CHECKING:
    from llguidance import LLMatcher, LLTokenizer
    from llguidance._lib import JsonCompileOptions  # a TypedDict its stubs alone define

MAX_CHOICES = 1024
MAX_PATTERN_CHARS = 4096
# Compact JSON with json.dumps' separators: no free whitespace, so a model cannot spend its
# tokens on blank lines (a known failure of whitespace-flexible JSON modes), and the output is
# what `json.dumps` writes.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Subschemas compiled, at most, to find the part of a schema an error comes from.
LOCATE_BUDGET = 64
UNIMPLEMENTED_KEYS = re.compile(r"Unimplemented keys: (\[.*?\])")
EXTRA = "pip install 'mili[structured]'"


class Format(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True)


class JsonObjectFormat(Format):
    """Any JSON object (OpenAI's JSON mode)."""

    type: Literal["json_object"]


class JsonSchema(Format):
    """OpenAI's `json_schema` object. `strict` is accepted and changes nothing: the schema is
    always enforced. Without `schema`, any JSON value matches (the empty schema)."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class JsonSchemaFormat(Format):
    type: Literal["json_schema"]
    json_schema: JsonSchema


class RegexFormat(Format):
    """The whole output matches `pattern` (vLLM's guided_regex; Rust regex syntax, no look-around)."""

    type: Literal["regex"]
    pattern: str = Field(min_length=1, max_length=MAX_PATTERN_CHARS)


class ChoiceFormat(Format):
    """The whole output is one of `choices` (vLLM's guided_choice)."""

    type: Literal["choice"]
    choices: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1, max_length=MAX_CHOICES)


ResponseFormat = Annotated[
    JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat,
    Field(discriminator="type"),
]
FORMAT_TYPES = ("json_object", "json_schema", "regex", "choice")


def grammar_text(fmt: JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat) -> str:
    """The format as an llguidance grammar (its JSON serialization), what the worker compiles."""
    matcher: type[LLMatcher] = llguidance().LLMatcher
    if isinstance(fmt, JsonObjectFormat):
        return matcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if isinstance(fmt, JsonSchemaFormat):
        return matcher.grammar_from_json_schema(fmt.json_schema.schema_, overrides=JSON_OPTIONS)
    if isinstance(fmt, RegexFormat):
        return matcher.grammar_from_regex(fmt.pattern)
    # Lark string literals take JSON's escapes, so any choice is one literal.
    return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in fmt.choices))


def check_format(fmt: JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat, at: str | None = None) -> None:
    """Raises InvalidArgument, naming the part of the format at fault and quoting the grammar
    library, when the worker could not compile it, or not follow it at its pace (a regex too large:
    producer_client.regex_size). `at` is where the format's schema, pattern or choices sit in the
    caller's request (by default, in `response_format`)."""
    refuse(fmt, at, compile_error(fmt.model_dump_json()))


def check_size(fmt: JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat, at: str | None = None) -> None:
    """check_format's refusal of a regex too large alone: a worker's, of a job no client checked
    (a producer's raw XADD), with no compile on its loop."""
    refuse(fmt, at, too_large(fmt))


def schema_format(schema: dict[str, Any]) -> JsonSchemaFormat:
    """A JSON schema alone as a format (a tool's parameters, which a forced call must match)."""
    return JsonSchemaFormat(type="json_schema", json_schema=JsonSchema(name="schema", schema_=schema))


def refuse(
    fmt: JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat,
    at: str | None,
    error: tuple[str, tuple[str, ...]] | None,
) -> None:
    if error is None:
        return
    message, path = error
    if at is None:
        at = "response_format" + {"json_schema": ".json_schema.schema", "regex": ".pattern", "choice": ".choices"}.get(
            fmt.type, ""
        )
    raise InvalidArgument(".".join((at, *path)), message)


@functools.lru_cache(maxsize=256)
def compile_error(fmt_json: str) -> tuple[str, tuple[str, ...]] | None:
    """(the library's message, the path of the failing part within the format's schema) or None.
    Cached: a bulk submit or a request with many choices sends one format many times."""
    fmt = format_from_json(fmt_json)
    message = grammar_error(grammar_text(fmt))
    if message is None:
        return too_large(fmt)
    refused = f"the grammar library refuses it: {message}"
    if isinstance(fmt, JsonSchemaFormat):
        return refused, tuple(locate(fmt.json_schema.schema_, message))
    return refused, ()


def too_large(
    fmt: JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat,
) -> tuple[str, tuple[str, ...]] | None:
    """A regex of the format the library compiles but the worker could not follow at its pace
    (producer_client.regex_size), as compile_error says it."""
    if isinstance(fmt, RegexFormat):
        patterns: list[tuple[tuple[str, ...], str]] = [((), fmt.pattern)]
    elif isinstance(fmt, JsonSchemaFormat):
        patterns = list(regex_size.schema_patterns(fmt.json_schema.schema_))
    else:
        return None
    for path, pattern in patterns:
        message = regex_size.oversized(pattern)
        if message is not None:
            return message, path
    return None


def format_from_json(fmt_json: str) -> JsonObjectFormat | JsonSchemaFormat | RegexFormat | ChoiceFormat:
    from pydantic import TypeAdapter

    return TypeAdapter(ResponseFormat).validate_json(fmt_json)


def grammar_error(grammar: str) -> str | None:
    matcher: type[LLMatcher] = llguidance().LLMatcher
    message = matcher.validate_grammar(grammar, byte_tokenizer())
    return message.strip() or None


def locate(schema: dict[str, Any], message: str) -> list[str]:
    """The path to the deepest subschema that fails alone with the same message (the root's
    definitions beside it, for its `$ref`s), then the keyword the message names, if any."""
    definitions: dict[str, Any] = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
    tries = iter(range(LOCATE_BUDGET))
    path, node = [], schema
    while (found := failing_subschema(node, definitions, message, tries)) is not None:
        key, node = found
        path.append(key)
    keys = UNIMPLEMENTED_KEYS.search(message)
    if keys is not None:
        path.extend([k for k in json.loads(keys.group(1)) if k in node][:1])
    return path


def failing_subschema(
    node: dict[str, Any],
    definitions: dict[str, Any],
    message: str,
    tries: Iterator[int],
) -> tuple[str, dict[str, Any]] | None:
    """The first subschema of `node` that fails alone with `message`, within the tries left."""
    for (key, child), _ in zip(subschemas(node), tries):
        matcher: type[LLMatcher] = llguidance().LLMatcher
        grammar = matcher.grammar_from_json_schema({**definitions, **child}, overrides=JSON_OPTIONS)
        if grammar_error(grammar) == message:
            return key, child
    return None


def subschemas(node: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path step, subschema) of each schema directly inside `node`."""
    for keyword, value in node.items():
        if isinstance(value, dict) and keyword in ("properties", "patternProperties", "$defs", "definitions"):
            for name, child in value.items():
                if isinstance(child, dict):
                    yield f"{keyword}.{name}", child
        elif isinstance(value, dict) and keyword not in ("const", "default", "enum", "examples"):
            yield keyword, value
        elif isinstance(value, list) and keyword in ("anyOf", "oneOf", "allOf", "prefixItems", "items"):
            for i, child in enumerate(value):
                if isinstance(child, dict):
                    yield f"{keyword}.{i}", child


@functools.cache
def byte_tokenizer() -> LLTokenizer:
    """A vocabulary of the 256 bytes and an end token: enough to build the whole grammar (its
    lexer, and the checks that find an unsatisfiable schema), in a few milliseconds."""
    lib = llguidance()
    tokenizer: LLTokenizer = lib.LLTokenizer(lib.TokenizerWrapper(ByteVocabulary()))
    return tokenizer


class ByteVocabulary:
    """What llguidance's TokenizerWrapper reads from a tokenizer."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


def llguidance() -> ModuleType:
    """llguidance, imported at the first format checked (its classes typed where they are used)."""
    try:
        import llguidance as lib
    except ImportError:
        raise InvalidArgument(
            "response_format",
            f"checking a format before it is queued needs the grammar library llguidance: {EXTRA}",
        ) from None
    return lib
