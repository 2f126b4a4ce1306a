"""Structured outputs through the gateway, with the official SDK as its users call it: OpenAI's
`response_format` (create, stream, and the SDK's `parse` from a pydantic model), vLLM's guided
fields, a forced tool call; every request body checked against OpenAI's spec, every answer
against its schema; what cannot compile is a 400 naming the part of the schema, before any job
is enqueued. The worker is the session's tiny model (random weights: the mask does the work)."""

import itertools
import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.openai_spec import check
from tests.support.jobs import job_ids

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
CHAT = [{"role": "user", "content": "Who is it? Answer in JSON."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=120)
    admin: bool


def test_a_chat_with_a_json_schema_answers_valid_json(sdk):
    body = {
        "model": "tiny",
        "messages": CHAT,
        "max_tokens": 80,
        "response_format": FORMAT,
        "temperature": 0.7,
        "seed": 1,
    }
    check("CreateChatCompletionRequest", body)
    for n in (1, 3):
        reply = sdk.chat.completions.create(**{**body, "n": n}, extra_body=NO_THINKING)
        check("CreateChatCompletionResponse", reply.model_dump(mode="json", exclude_unset=True))
        assert len(reply.choices) == n
        for choice in reply.choices:
            assert choice.finish_reason == "stop", choice
            jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_a_streamed_chat_with_a_json_schema_adds_up_to_valid_json(sdk):
    chunks = list(
        sdk.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=80,
            response_format=FORMAT,
            stream=True,
            extra_body=NO_THINKING,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), PERSON)


def test_the_sdks_parse_helper_turns_the_answer_into_the_pydantic_model(sdk):
    completion = sdk.chat.completions.parse(
        model="tiny",
        messages=CHAT,
        max_tokens=80,
        response_format=Person,
        temperature=1.0,
        seed=3,
        extra_body=NO_THINKING,
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Person) and 0 <= parsed.age <= 120


def test_json_object_in_a_chat_is_a_json_object_or_cut_by_length(sdk):
    reply = sdk.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=60,
        response_format={"type": "json_object"},
        temperature=0,
        extra_body=NO_THINKING,
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # any object: a random model may write one endless string
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "extra, valid",
    [
        ({"guided_json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
        ({"guided_json": json.dumps(PERSON)}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
        ({"guided_regex": "[a-z]{3}-[0-9]{2}"}, lambda text: re.fullmatch("[a-z]{3}-[0-9]{2}", text) is not None),
        ({"guided_choice": ["positive", "negative"]}, lambda text: text in ("positive", "negative")),
        ({"response_format": FORMAT}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    ],
)
def test_text_completions_take_the_guided_fields_and_response_format(sdk, extra, valid):
    reply = sdk.completions.create(
        model="tiny", prompt="Answer:", max_tokens=80, temperature=1.0, seed=2, extra_body=extra
    )
    check("CreateCompletionResponse", reply.model_dump(mode="json", exclude_unset=True))
    assert reply.choices[0].finish_reason == "stop" and valid(reply.choices[0].text), reply.choices[0].text


def test_a_required_tool_choice_makes_a_call_with_valid_arguments(sdk):
    weather = {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": weather}}]
    for tool_choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        reply = sdk.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=80,
            tools=tools,
            tool_choice=tool_choice,
            temperature=1.0,
            seed=4,
            extra_body=NO_THINKING,
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), weather)


@pytest.mark.parametrize(
    "path, extra, param",
    [
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
                    },
                }
            },
            "response_format.json_schema.schema.properties.a.not",
        ),
        (
            "/v1/chat/completions",
            {"guided_json": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=a)"}}}},
            "guided_json.properties.a",
        ),
        ("/v1/completions", {"guided_regex": "[a-"}, "guided_regex"),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"}, "stop": "}"}, "stop"),
    ],
)
def test_what_cannot_compile_is_a_400_naming_it_before_anything_is_enqueued(sdk, redis_client, path, extra, param):
    before = job_ids(redis_client)
    with pytest.raises(openai.BadRequestError) as refused:
        if path == "/v1/chat/completions":
            sdk.chat.completions.create(model="tiny", messages=CHAT, extra_body=extra)
        else:
            sdk.completions.create(model="tiny", prompt="x", extra_body=extra)
    error = refused.value.body
    assert (error["param"], error["code"]) == (param, "invalid_value"), error
    assert job_ids(redis_client) <= before


MARKER_CHOICES = ["<think>yes</think>", "<tool_call>no</tool_call>", "<|im_end|>"]


def test_a_format_that_spells_qwens_markers_is_answered_exactly_with_thinking_off(sdk):
    # Each was a 500: the marker's spelling was forced as the marker's token, which the grammar refused.
    chat = dict(model="tiny", messages=CHAT, max_tokens=40, temperature=1.0, seed=5)
    choice = sdk.chat.completions.create(**chat, extra_body={**NO_THINKING, "guided_choice": MARKER_CHOICES})
    assert (choice.choices[0].finish_reason, choice.choices[0].message.content in MARKER_CHOICES) == ("stop", True)
    regex = "<tool_call>[a-z]{2}</tool_call>"
    text = sdk.completions.create(model="tiny", prompt="x", max_tokens=40, seed=6, extra_body={"guided_regex": regex})
    assert re.fullmatch(regex, text.choices[0].text) and text.choices[0].finish_reason == "stop", text
    schema = {"type": "object", "properties": {"m": {"enum": ["<think>", "<|im_end|>"]}}, "required": ["m"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "m", "schema": schema}}
    answer = sdk.chat.completions.create(**chat, response_format=fmt, extra_body=NO_THINKING).choices[0]
    assert answer.finish_reason == "stop" and json.loads(answer.message.content)["m"] in ("<think>", "<|im_end|>")


THINKING_FORMATS = {
    "choice": {"guided_choice": ["<think>yes</think>", "\t green"]},
    "json": {"response_format": FORMAT},
}


def test_with_thinking_on_the_answer_is_exactly_the_format_and_never_in_the_reasoning(sdk):
    # A random model opens the think block or answers at its first token; thinking, it rarely ends in time.
    answered = set()
    for (kind, extra), seed in itertools.product(THINKING_FORMATS.items(), range(4)):
        reply = sdk.chat.completions.create(
            model="tiny", messages=CHAT, max_tokens=40, temperature=1.0, seed=seed, extra_body=extra
        ).choices[0]
        if reply.finish_reason == "length":
            continue
        answered.add(kind)
        content, reasoning = reply.message.content, getattr(reply.message, "reasoning_content", None)
        assert reply.finish_reason == "stop", reply
        if kind == "json":  # was "   \t{...}" without a think block
            assert content.startswith("{") and jsonschema.validate(json.loads(content), PERSON) is None, content
        elif reasoning is None:  # the other choice opens with <think>: only after a think block
            assert content == "\t green", content
        else:
            assert content in ("<think>yes</think>", "\t green"), content
    assert answered == set(THINKING_FORMATS)


class Item(pydantic.BaseModel):
    sku: str = pydantic.Field(pattern="^[A-Z]{2}$")


class Order(pydantic.BaseModel):
    items: list[Item] = pydantic.Field(min_length=1, max_length=2)


def test_a_forced_call_of_a_pydantic_tool_with_nested_models_is_valid(sdk):
    # Its parameters' $refs point into their own $defs: a 400 while the grammar nested them deeper.
    tool = openai.pydantic_function_tool(Order)
    for tool_choice in ("required", {"type": "function", "function": {"name": "Order"}}):
        reply = sdk.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=80,
            tools=[tool],
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            temperature=1.0,
            seed=7,
            extra_body=NO_THINKING,
        ).choices[0]
        assert reply.finish_reason == "tool_calls", reply
        [call] = reply.message.tool_calls
        Order.model_validate_json(call.function.arguments)


@pytest.mark.parametrize(
    "extra, param",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "no spaces"}}},
            "response_format.json_schema.name",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "regex"}}, "response_format.type"),
        ({"response_format": {}}, "response_format.type"),
        ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
        ({"guided_choice": ["a", ""]}, "guided_choice.1"),
        ({"guided_choice": ["a"] * 1025}, "guided_choice"),
        ({"guided_regex": "a" * 4097}, "guided_regex"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
    ],
)
def test_a_malformed_format_is_a_400_naming_the_field_the_request_has(sdk, redis_client, extra, param):
    before = job_ids(redis_client)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model="tiny", messages=CHAT, extra_body=extra)
    assert refused.value.body["param"] == param, refused.value.body
    assert job_ids(redis_client) <= before


@pytest.mark.timing  # a pause against the compile's time: the load of tests beside it moves both
def test_a_grammar_being_compiled_holds_no_other_request(gateway):
    """The grammar library takes up to seconds to compile a schema (60,000 values here), letting the
    GIL go: compiled on the event loop, it held every request behind it, and a key sending such
    schemas held them all. Four distinct ones (no cache to hit) are compiled while /v1/models is
    answered at once; the echo model then refuses them (it follows no grammar)."""
    url = f"{gateway.url}/v1/chat/completions"

    def heavy(n: int) -> tuple[httpx.Response, float]:
        schema = {"enum": [f"{n}-{value}" for value in range(60_000)]}
        body = {
            "model": "echo",
            "messages": [{"role": "user", "content": "x"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        }
        started = time.monotonic()
        return httpx.post(url, json=body, timeout=120), time.monotonic() - started

    with ThreadPoolExecutor(4) as pool:
        compiling = [pool.submit(heavy, n) for n in range(4)]
        time.sleep(0.3)  # their bodies are in, their grammars compiling
        started = time.monotonic()
        assert httpx.get(f"{gateway.url}/v1/models", timeout=120).status_code == 200
        waited = time.monotonic() - started
        answers = [future.result() for future in compiling]
    assert all(answer.status_code == 400 for answer, _ in answers), [a.text for a, _ in answers]
    fastest = min(seconds for _, seconds in answers)
    # On the loop, /v1/models would wait for at least one compile (~0.5 s alone on this VM, seconds
    # beside a loaded lane): it must stand well above a request's few ms to be seen.
    assert fastest > 0.2, "the grammars compiled too fast to hold anything"
    assert waited < fastest / 3, (waited, [seconds for _, seconds in answers])
