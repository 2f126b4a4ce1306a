"""OpenAI's published OpenAPI spec as the contract (tests/openai_spec: its component schemas at a
recorded commit): every kind of response the gateway sends validates against its schema;
requests the spec allows are accepted (nullable fields, inclusive bounds, parameters at their
defaults); what MILI cannot honour is a 400 naming the parameter; a streamed request is
validated before its stream starts. Plain httpx, so that the bytes on the wire are checked."""

import io
import json

import httpx
import openai
import pytest

from harness.polling import eventually
from openai_format import requests
from openai_format.errors import APIError
from openai_format.job_specs import chat_jobs, completion_jobs, parse_body
from openai_format.render import finish_reason
from producer_client import Client, JobResult
from tests.gateway.support import PARKED_MODEL, PARKED_QUEUE
from tests.openai_spec import SPEC, check, spec_text
from tests.support.jobs import job_ids

CHAT = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def post(gateway, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=60)


def sse_chunks(response: httpx.Response) -> list[dict]:
    events = response.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-2] if e.startswith("data: ")]


# -- every response validates ---------------------------------------------------------------------


def test_chat_completions_whole_and_streamed_validate(gateway):
    for model, extra in (("echo", {}), ("tiny", {"logprobs": True, "top_logprobs": 2, "temperature": 0})):
        whole = post(
            gateway, "/v1/chat/completions", {"model": model, "messages": CHAT, "max_tokens": 4, "n": 2, **extra}
        )
        assert whole.status_code == 200, whole.text
        check("CreateChatCompletionResponse", whole.json())
        streamed = post(
            gateway,
            "/v1/chat/completions",
            {
                "model": model,
                "messages": CHAT,
                "max_tokens": 4,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            },
        )
        chunks = sse_chunks(streamed)
        for chunk in chunks:
            check("CreateChatCompletionStreamResponse", chunk)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:] if c["choices"])


def test_text_completions_whole_and_streamed_validate(gateway):
    whole = post(
        gateway,
        "/v1/completions",
        {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 3, "logprobs": 2, "temperature": 0},
    )
    check("CreateCompletionResponse", whole.json())
    assert "text_offset" not in whole.json()["choices"][0]["logprobs"]
    streamed = post(
        gateway,
        "/v1/completions",
        {
            "model": "echo",
            "prompt": "abc",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    chunks = sse_chunks(streamed)
    for chunk in chunks[:-1]:
        check("CompletionStreamChunk", chunk)  # the spec's response schema, finish_reason null until the end
        assert "usage" not in chunk
    check("CreateCompletionResponse", chunks[-1])  # the usage chunk


def test_n_choices_streamed_validate_each_with_its_role_and_finish_once_then_the_usage(gateway):
    """n > 1 streamed (two prompts of a text completion, two choices each): every chunk validates,
    each choice gets its role once (chat) and one finish_reason, and the usage chunk comes last."""
    chat = {"messages": CHAT, "logprobs": True, "top_logprobs": 1}
    for path, extra, schema, n in (
        ("/v1/chat/completions", chat, "CreateChatCompletionStreamResponse", 2),
        ("/v1/completions", {"prompt": ["a", "b"], "logprobs": 1}, "CompletionStreamChunk", 4),
    ):
        body = {"model": "tiny", "max_tokens": 3, "ignore_eos": True, "n": 2, "stream": True, **extra}
        chunks = sse_chunks(post(gateway, path, {**body, "stream_options": {"include_usage": True}}))
        *deltas, last = chunks
        for chunk in deltas:
            check(schema, chunk)
        choices = [c for chunk in deltas for c in chunk["choices"]]
        assert sorted({c["index"] for c in choices}) == list(range(n))
        assert sorted(c["index"] for c in choices if c["finish_reason"] is not None) == list(range(n))
        if path == "/v1/chat/completions":
            assert sorted(c["index"] for c in choices if "role" in c["delta"]) == list(range(n))
        check(
            "CreateChatCompletionStreamResponse" if path == "/v1/chat/completions" else "CreateCompletionResponse", last
        )
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 3 * n, last


STREAM_USAGE = "/components/schemas/CreateChatCompletionStreamResponse/properties/usage/description"
INCLUDE_USAGE = "/components/schemas/ChatCompletionStreamOptions/anyOf/0/properties/include_usage/description"


def test_a_chat_streams_usage_is_absent_unless_include_usage_then_null_in_every_chunk_but_the_last(gateway):
    """The spec's rule, which its schema cannot say (`usage` is optional and nullable): the field
    is present only with `include_usage: true`, and then null in every chunk but the usage chunk
    (choices empty). Every chunk said `"usage": null` whatever the request asked."""
    assert 'only be present when you set `stream_options: {"include_usage": true}`' in spec_text(STREAM_USAGE)
    assert "null value **except for the last chunk**" in spec_text(STREAM_USAGE)
    assert "All other chunks will also include a `usage` field, but with a null value" in spec_text(INCLUDE_USAGE)
    body = {"model": "echo", "messages": CHAT, "max_tokens": 4, "n": 2, "stream": True}
    for options in ({}, {"stream_options": None}, {"stream_options": {"include_usage": False}}):
        chunks = sse_chunks(post(gateway, "/v1/chat/completions", {**body, **options}))
        for chunk in chunks:
            check("CreateChatCompletionStreamResponse", chunk)
        assert [c for c in chunks if "usage" in c] == [], options
        assert all(c["choices"] for c in chunks)  # no usage chunk either
    *chunks, last = sse_chunks(
        post(gateway, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    )
    for chunk in [*chunks, last]:
        check("CreateChatCompletionStreamResponse", chunk)
    assert [c["usage"] for c in chunks] == [None] * len(chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 8, last


def test_a_text_completions_stream_has_no_usage_but_in_its_usage_chunk(gateway):
    """A text completion's chunk is the spec's CreateCompletionResponse, whose `usage` is not
    nullable: the field is left out of every chunk, and only the usage chunk asked for has it."""
    body = {"model": "echo", "prompt": "abc", "max_tokens": 3, "stream": True}
    for options in ({}, {"stream_options": {"include_usage": False}}):
        chunks = sse_chunks(post(gateway, "/v1/completions", {**body, **options}))
        for chunk in chunks:
            check("CompletionStreamChunk", chunk)
        assert [c for c in chunks if "usage" in c] == [] and all(c["choices"] for c in chunks), options


def test_models_and_errors_validate(gateway):
    check("ListModelsResponse", httpx.get(f"{gateway.url}/v1/models").json())
    check("Model", httpx.get(f"{gateway.url}/v1/models/echo").json())
    for response in (
        post(gateway, "/v1/chat/completions", {"model": "echo"}),
        post(gateway, "/v1/chat/completions", {"model": "nobody", "messages": CHAT}),
        httpx.get(f"{gateway.url}/v1/files/file-{'0' * 32}"),
    ):
        assert response.status_code in (400, 404)
        check("ErrorResponse", response.json())


def test_files_and_batches_validate_and_files_are_listed(gateway, sdk):
    lines = "".join(
        json.dumps(
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {"model": "echo", "messages": CHAT, "max_tokens": 2},
            }
        )
        + "\n"
        for i in range(2)
    )
    lines += json.dumps(  # an error file's line: the gateway's 404
        {
            "custom_id": "c2",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "nobody", "messages": CHAT},
        }
    )
    uploaded = sdk.files.create(file=("in.jsonl", io.BytesIO(lines.encode())), purpose="batch")
    listed = httpx.get(f"{gateway.url}/v1/files").json()
    check("ListFilesResponse", listed)
    assert uploaded.id in [f["id"] for f in listed["data"]]
    assert [f.id for f in sdk.files.list(limit=1, order="desc").data] == [listed["data"][0]["id"]]
    assert [f.id for f in sdk.files.list(limit=2)] == [f["id"] for f in listed["data"]]  # the SDK's pages, by after=
    assert {f.purpose for f in sdk.files.list(purpose="batch_output")} <= {"batch_output"}
    check("OpenAIFile", httpx.get(f"{gateway.url}/v1/files/{uploaded.id}").json())

    created = httpx.post(
        f"{gateway.url}/v1/batches",
        json={
            "input_file_id": uploaded.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    ).json()
    check("Batch", created)

    def completed():
        batch = httpx.get(f"{gateway.url}/v1/batches/{created['id']}").json()
        check("Batch", batch)  # every state it passes through
        return batch if batch["status"] == "completed" else None

    batch = eventually(completed, 60, interval=0.2)
    assert batch, httpx.get(f"{gateway.url}/v1/batches/{created['id']}").json()
    check("ListBatchesResponse", httpx.get(f"{gateway.url}/v1/batches?limit=2").json())
    answered = [json.loads(line) for line in sdk.files.content(batch["output_file_id"]).text.split("\n")[:-1]]
    refused = [json.loads(line) for line in sdk.files.content(batch["error_file_id"]).text.split("\n")[:-1]]
    assert sorted(a["custom_id"] for a in answered) == ["c0", "c1"] and [r["custom_id"] for r in refused] == ["c2"]
    for line in answered:
        check("CreateChatCompletionResponse", line["response"]["body"])
    check("ErrorResponse", refused[0]["response"]["body"])
    assert refused[0]["response"]["status_code"] == 404
    ended = httpx.post(f"{gateway.url}/v1/batches/{created['id']}/cancel")
    assert ended.status_code == 400 and ended.json()["error"]["code"] == "batch_ended"  # a 409 the SDK would retry
    deleted = httpx.delete(f"{gateway.url}/v1/files/{uploaded.id}").json()
    check("DeleteFileResponse", deleted)
    assert uploaded.id not in [f["id"] for f in httpx.get(f"{gateway.url}/v1/files").json()["data"]]


# -- what the spec allows is accepted ---------------------------------------------------------------

SDK_ASSISTANT = {
    "role": "assistant",
    "content": "hello",
    "refusal": None,
    "annotations": [],
}  # a message object, sent back
ACCEPTED_CHATS = [
    {
        "n": None,
        "stream": None,
        "logprobs": None,
        "temperature": None,
        "top_p": None,
        "seed": None,
        "stop": None,
        "max_tokens": None,
        "max_completion_tokens": 4,
        "presence_penalty": None,
        "frequency_penalty": None,
        "stream_options": None,
        "logit_bias": None,
        "metadata": None,
        "store": None,
        "service_tier": None,
        "audio": None,
        "prediction": None,
    },
    {
        "temperature": 2,
        "top_p": 0,
        "seed": -(2**63),
        "presence_penalty": -2,
        "frequency_penalty": 2,
        "n": 128,
        "logprobs": True,
        "top_logprobs": 0,
    },
    {"seed": 2**63 - 1, "n": 3},
    {
        "logit_bias": {},
        "store": False,
        "response_format": {"type": "text"},
        "service_tier": "auto",
        "modalities": ["text"],
        "metadata": {"k": "v"},
        "user": "u",
        "prompt_cache_key": "p",
        "safety_identifier": "s",
        "stop": "x",
        "stream_options": {"include_usage": True, "include_obfuscation": False},
        "stream": True,
        "verbosity": "medium",  # the spec's default: MILI refused every value but null
    },
    {
        "messages": [
            {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
            *CHAT,
            SDK_ASSISTANT,
            {"role": "assistant", "content": None, "refusal": "I can't."},
            {"role": "user", "content": "ok"},
        ]
    },
    {
        "messages": [
            *CHAT,
            {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "refusal", "refusal": "b"}]},
            {"role": "user", "content": "c", "name": "me"},
        ],
        "tools": [],
        "tool_choice": "auto",
    },
    {  # prompt caching hints: MILI's radix cache finds shared prefixes by itself
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}],
            }
        ],
        "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    },
    {
        "messages": [
            {
                "role": "system",
                "content": [{"type": "text", "text": "s", "prompt_cache_breakpoint": {"mode": "explicit"}}],
            },
            *CHAT,
            {
                "role": "assistant",
                "content": [{"type": "text", "text": "a", "prompt_cache_breakpoint": {"mode": "explicit"}}],
            },
            *CHAT,
        ],
        "prompt_cache_options": {"mode": "explicit"},
    },
]


def spec_properties(name: str) -> set[str]:
    """The request fields schema `name` of the spec names, its allOf parts' included."""
    schema = SPEC["$defs"][name]
    names: set[str] = set()
    for part in schema.get("allOf", [schema]):
        if "$ref" in part:
            names |= spec_properties(part["$ref"].rsplit("/", 1)[-1])
        names |= set(part.get("properties", {}))
    return names


@pytest.mark.parametrize(
    "spec_name, model",
    [
        ("CreateChatCompletionRequest", requests.ChatCompletionRequest),
        ("CreateCompletionRequest", requests.CompletionRequest),
        ("ChatCompletionRequestSystemMessage", requests.SystemMessage),
        ("ChatCompletionRequestDeveloperMessage", requests.SystemMessage),
        ("ChatCompletionRequestUserMessage", requests.UserMessage),
        ("ChatCompletionRequestAssistantMessage", requests.AssistantMessage),
        ("ChatCompletionRequestToolMessage", requests.ToolMessage),
        ("ChatCompletionRequestMessageContentPartText", requests.TextPart),
        ("ChatCompletionRequestMessageContentPartRefusal", requests.RefusalPart),
    ],
)
def test_every_field_of_the_specs_requests_is_known_never_an_unknown_parameter(spec_name, model):
    """`unknown_parameter` is for a field the spec does not have: each one it has is honoured,
    accepted with no effect, or refused as unsupported_parameter, by a field of its own."""
    assert spec_properties(spec_name) - set(model.model_fields) == set()


@pytest.mark.parametrize("extra", ACCEPTED_CHATS)
def test_chats_the_spec_allows_are_accepted(gateway, extra):
    body = {"model": "echo", "messages": CHAT, "max_tokens": 4, **extra}
    check("CreateChatCompletionRequest", body)
    response = post(gateway, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text


def test_an_assistant_message_dumped_whole_by_the_sdk_is_accepted_though_the_spec_lists_no_null_tool_calls(gateway):
    dumped = {
        **SDK_ASSISTANT,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "tool_calls": None,
    }  # message.model_dump()
    response = post(
        gateway, "/v1/chat/completions", {"model": "echo", "messages": [*CHAT, dumped, *CHAT], "max_tokens": 4}
    )
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "extra",
    [
        {
            "echo": False,
            "best_of": 1,
            "suffix": None,
            "logit_bias": {},
            "logprobs": 5,
            "n": None,
            "stream": None,
            "user": "u",
        },
        {"best_of": 2, "n": 2, "seed": -1, "temperature": 0, "top_p": 1, "suffix": "", "max_tokens": None},
    ],
)
def test_completions_the_spec_allows_are_accepted(gateway, extra):
    body = {"model": "echo", "prompt": "hi", "max_tokens": 2, **extra}
    check("CreateCompletionRequest", body)
    response = post(gateway, "/v1/completions", body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("prompt", [None, "", [""]])
def test_a_null_or_empty_prompt_is_the_specs_default_the_document_start(gateway, prompt):
    """The spec's prompt is nullable, its strings may be empty, and its default is
    `<|endoftext|>` (Qwen3's document start too, one token): it was a 400 (a prompt of no token)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    check("CreateCompletionRequest", body)
    response = post(gateway, "/v1/completions", body)
    assert response.status_code == 200, response.text
    check("CreateCompletionResponse", response.json())
    assert response.json()["usage"]["prompt_tokens"] == 1


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"echo": True}, "echo"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"logit_bias": {"50256": -100}}, "logit_bias"),
        ("/v1/chat/completions", {"store": True}, "store"),
        ("/v1/chat/completions", {"service_tier": "scale"}, "service_tier"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
        ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
        ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        # Of the spec's, but not MILI's: a custom tool, an allowed_tools or custom choice (invalid_value).
        ("/v1/chat/completions", {"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools.0"),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            {"tools": TOOLS, "tool_choice": {"type": "custom", "custom": {"name": "f"}}},
            "tool_choice",
        ),
        # A custom tool's call in history, as OpenAI answers one (it was an invalid_value of its type).
        (
            "/v1/chat/completions",
            {
                "messages": [
                    *CHAT,
                    {
                        "role": "assistant",
                        "tool_calls": [{"id": "c", "type": "custom", "custom": {"name": "f", "input": "x"}}],
                    },
                    *CHAT,
                ]
            },
            "messages.1.tool_calls.0",
        ),
        # The deprecated functions' answer, a message of role `function` (it was an invalid_value).
        (
            "/v1/chat/completions",
            {"messages": [*CHAT, {"role": "function", "name": "f", "content": "y"}]},
            "messages.1.role",
        ),
    ],
)
def test_what_mili_cannot_honour_is_a_400_naming_it_and_enqueues_nothing(gateway, redis_client, path, body, param):
    chat = path.endswith("chat/completions")
    full = {"model": "echo", **({"messages": CHAT} if chat else {"prompt": "hi"}), **body}
    check("CreateChatCompletionRequest" if chat else "CreateCompletionRequest", full)  # OpenAI would take it
    before = job_ids(redis_client)
    response = post(gateway, path, full)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (param, "unsupported_parameter", "invalid_request_error")
    assert job_ids(redis_client) <= before


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/v1/batches/"),  # was a 307 to /v1/batches (FastAPI's redirect_slashes)
        ("POST", "/v1/chat/completions/"),  # was a 307: the SDK sent the body again, and got an answer
        ("GET", "/v1/files/file-x/content/"),
        ("GET", "/v1/models/"),  # was a 404 model_not_found of a model named ''
        ("GET", "/v1/jobs/"),  # was a 400 invalid_value naming job_id
        ("GET", "/v1/nope"),
        ("POST", "/v1/responses"),
        ("GET", "/"),
    ],
)
def test_a_path_the_gateway_has_not_is_openais_404_unknown_url_never_a_redirect(gateway, redis_client, method, path):
    """OpenAI answers a path it has not, a trailing slash's too, with its error object: a 404
    `unknown_url` naming the method and path. A redirect to the path without the slash is no
    answer a spec client expects (a 307 has no error object; the SDK follows it)."""
    before = job_ids(redis_client)
    body = {"model": "echo", "messages": CHAT, "max_tokens": 1} if method == "POST" else None
    answer = httpx.request(method, f"{gateway.url}{path}", json=body, timeout=30)
    assert answer.status_code == 404, (answer.status_code, answer.headers.get("location"))
    check("ErrorResponse", answer.json())
    error = answer.json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "unknown_url", None)
    assert error["message"].startswith(f"Unknown request URL: {method} {path}. ")
    assert answer.headers["x-request-id"]
    assert job_ids(redis_client) <= before


def test_a_path_the_sdk_asks_with_a_trailing_slash_raises_not_found_with_the_code(sdk, redis_client):
    before = job_ids(redis_client)
    for call in (
        lambda: sdk.get("/batches/", cast_to=object),
        lambda: sdk.post("/chat/completions/", cast_to=object, body={"model": "echo", "messages": CHAT}),
    ):
        with pytest.raises(openai.NotFoundError) as refused:
            call()
        assert refused.value.code == "unknown_url"
    assert job_ids(redis_client) <= before


def test_embeddings_are_a_400_saying_mili_generates_text_and_enqueue_nothing(gateway, sdk, redis_client):
    """docs/http-api.md lists embeddings among what is refused with a 400 naming it; the SDK's
    embeddings.create got the 404 'Not Found' of a route the gateway has not, as a wrong base_url."""
    before = job_ids(redis_client)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.embeddings.create(model="echo", input="hi")
    assert (refused.value.code, refused.value.type) == ("unsupported_endpoint", "invalid_request_error")
    assert "embeddings are not supported" in refused.value.message
    check("ErrorResponse", refused.value.response.json())
    assert job_ids(redis_client) <= before


def test_a_service_tier_the_spec_has_not_is_an_invalid_value_not_an_unsupported_one(gateway, redis_client):
    """Only the spec's tier MILI does not run (scale) is unsupported_parameter; the message of a
    value the spec has not lists only the tiers MILI takes (it listed scale too)."""
    before = job_ids(redis_client)
    for tier in ("bogus", "null", 5):
        response = post(gateway, "/v1/chat/completions", {"model": "echo", "messages": CHAT, "service_tier": tier})
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (400, "service_tier", "invalid_value")
        assert error["message"] == "service_tier: Input should be 'auto', 'default', 'flex', 'priority' or 'fast'"
    assert job_ids(redis_client) <= before


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-1"}},
    ],
)
def test_an_image_audio_or_file_part_is_a_400_saying_mili_serves_text_only(gateway, redis_client, part):
    body = {"model": "echo", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]}
    check("CreateChatCompletionRequest", body)  # OpenAI would take it
    before = job_ids(redis_client)
    response = post(gateway, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert response.json()["error"] == {
        "message": f"messages.0.content part 1 is of type {part['type']}, which MILI does not support: "
        "it serves text only (send a string or text parts)",
        "type": "invalid_request_error",
        "param": "messages.0.content",
        "code": "unsupported_parameter",
    }
    assert job_ids(redis_client) <= before


# -- validated before the stream, finish reasons of the enum -------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "x" * 5000}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 5000}]}, "messages"),
    ],
)
def test_a_streamed_prompt_too_long_is_a_400_before_the_stream(gateway, sdk, path, body, param):
    response = post(
        gateway, path, {"model": "echo", "max_tokens": 4, "stream": True, **body}
    )  # the echo worker's context: 4096
    assert response.status_code == 400, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    with pytest.raises(openai.BadRequestError):
        sdk.completions.create(model="echo", prompt="x" * 5000, max_tokens=4, stream=True)


def test_a_job_cancelled_mid_stream_ends_with_stop_and_its_reason_beside(gateway, redis_server):
    with Client(redis_server.url, PARKED_QUEUE) as client, httpx.Client(timeout=60) as http:
        with http.stream(
            "POST", f"{gateway.url}/v1/completions", json={"model": PARKED_MODEL, "prompt": "wait", "stream": True}
        ) as response:
            job_id = response.headers["x-mili-job-ids"]  # the stream began after stream_hold_s: the job waits
            assert eventually(lambda: client.status(job_id).status == "queued", timeout=5)
            client.cancel(job_id)
            chunks = [
                json.loads(line.removeprefix("data: ")) for line in response.iter_lines() if line.startswith("data: {")
            ]
    last = chunks[-1]["choices"][0]
    assert (last["finish_reason"], last["finish_detail"]) == ("stop", "cancelled")
    check("CompletionStreamChunk", chunks[-1])


@pytest.mark.parametrize(
    "result, expected",
    [
        (JobResult(id="j", status="done", finish_reason="stop"), ("stop", None)),
        (JobResult(id="j", status="done", finish_reason="length"), ("length", None)),
        (JobResult(id="j", status="done", finish_reason="tool_calls"), ("tool_calls", None)),
        (JobResult(id="j", status="cancelled", finish_reason="abort"), ("stop", "cancelled")),
        (JobResult(id="j", status="done", finish_reason="timeout"), ("length", "deadline_exceeded")),
    ],
)
def test_finish_reasons_are_the_specs_with_the_reason_a_job_was_cut_short_beside(result, expected):
    assert finish_reason(result) == expected


def spec_property_schemas(name: str) -> dict:
    """A request schema's properties, those of the schemas it is made of (allOf) included."""
    schema = SPEC["$defs"][name]
    found = dict(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        found.update(
            spec_property_schemas(part["$ref"].rsplit("/", 1)[-1]) if "$ref" in part else part.get("properties", {})
        )
    return found


def spec_bounds(name: str) -> list[tuple[str, str, str, float]]:
    """(property, its JSON type, "minimum" or "maximum", the bound) of each bounded number."""
    bounds = []
    for prop, schema in spec_property_schemas(name).items():
        for alt in (schema, *schema.get("anyOf", []), *schema.get("oneOf", [])):
            if alt.get("type") in ("integer", "number"):
                bounds += [(prop, alt["type"], side, alt[side]) for side in ("minimum", "maximum") if side in alt]
    return bounds


def spec_default(schema: dict) -> tuple[bool, object]:
    """(True, the default) that a property's schema, or one of its alternatives, states."""
    if "default" in schema:
        return True, schema["default"]
    if "$ref" in schema:
        return spec_default(SPEC["$defs"][schema["$ref"].rsplit("/", 1)[-1]])
    for alt in (*schema.get("anyOf", []), *schema.get("oneOf", [])):
        found, value = spec_default(alt)
        if found:
            return found, value
    return False, None


# A default the docs name as refused all the same (docs/http-api.md, Not supported): Qwen3's
# thinking is on or off, chat_template_kwargs' enable_thinking, and has no effort to set.
REFUSED_AT_DEFAULT = {("CreateChatCompletionRequest", "reasoning_effort")}


REQUESTS = [
    ("CreateChatCompletionRequest", requests.ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}]}),
    ("CreateCompletionRequest", requests.CompletionRequest, {"prompt": "x"}),
]
# A bound the spec states that the request model leaves to the client library, whose refusal is
# checked (with its code) through the gateway in test_numeric_ranges.
CHECKED_LATER = {("CreateCompletionRequest", "max_tokens")}


@pytest.mark.parametrize("name, model, body", REQUESTS)
def test_every_bound_of_the_spec_is_refused_with_openais_code_for_its_type(name, model, body):
    """Each number the spec bounds, just past each bound, is a 400 naming it with OpenAI's code for
    an integer (`integer_above_max_value`) or a decimal (`decimal_below_min_value`) as the spec
    types it: the kind comes from the request model's bounds, which must agree with the spec's."""
    bounds = spec_bounds(name)
    assert {prop for prop, *_ in bounds} >= {"temperature", "top_p", "n", "presence_penalty"}, bounds
    for prop, kind, side, bound in bounds:
        if (name, prop) in CHECKED_LATER:
            continue
        step = 1 if kind == "integer" else 0.5
        value = bound + step if side == "maximum" else bound - step
        extra = {"logprobs": True} if prop == "top_logprobs" else {}
        with pytest.raises(APIError) as refused:
            parse_body(model, json.dumps({"model": "m", **body, **extra, prop: value}))
        error = refused.value.body.error
        words = ("integer" if kind == "integer" else "decimal", "above_max" if side == "maximum" else "below_min")
        assert (refused.value.status, error.type, error.param, error.code) == (
            400,
            "invalid_request_error",
            prop,
            f"{words[0]}_{words[1]}_value",
        ), (prop, value)


@pytest.mark.parametrize("name, model, body", REQUESTS)
def test_every_field_the_spec_gives_a_default_is_accepted_at_it(name, model, body):
    """docs/http-api.md: a parameter MILI cannot honour is accepted at its default. The spec's
    stated defaults, each sent alone, parse (verbosity "medium" was refused as unsupported)."""
    defaults = {}
    for prop, schema in spec_property_schemas(name).items():
        found, value = spec_default(schema)
        if found and (name, prop) not in REFUSED_AT_DEFAULT:
            defaults[prop] = value
    assert {"temperature", "n"} <= set(defaults), defaults
    for prop, value in defaults.items():
        parse_body(model, json.dumps({"model": "m", **body, prop: value}))


@pytest.mark.parametrize(
    "guided, expected",
    [
        ({"guided_regex": "[a-z]+"}, {"type": "regex", "pattern": "[a-z]+"}),
        ({"guided_choice": ["yes", "no"]}, {"type": "choice", "choices": ["yes", "no"]}),
        (
            {"guided_json": {"type": "object"}},
            {"type": "json_schema", "json_schema": {"name": "guided_json", "schema": {"type": "object"}}},
        ),
    ],
)
def test_response_format_text_beside_a_guided_field_leaves_the_format_to_that_field(guided, expected):
    """`text` is the spec's default, no format at all (vLLM takes the pair): it was a 400 'give
    one of ...'. json_object or json_schema beside a guided field still conflicts."""
    for model, body in (
        (requests.ChatCompletionRequest, {"messages": CHAT}),
        (requests.CompletionRequest, {"prompt": "x"}),
    ):
        full = {"model": "tiny", **body, "response_format": {"type": "text"}, **guided}
        (spec,) = parse_body_and_jobs(model, full)
        assert spec.sampling["response_format"] == expected
        with pytest.raises(APIError) as refused:
            parse_body_and_jobs(model, {**full, "response_format": {"type": "json_object"}})
        assert (refused.value.body.error.param, refused.value.body.error.code) == (next(iter(guided)), "invalid_value")


def parse_body_and_jobs(model, body: dict):
    req = parse_body(model, json.dumps(body))
    return chat_jobs(req) if "messages" in body else completion_jobs(req)


def test_prompt_cache_retention_in_memory_is_what_the_radix_cache_does_and_24h_is_unsupported():
    """The spec's two values: in_memory (prefixes kept in memory while there is room: MILI's radix
    cache) is accepted with no effect; 24h (extended caching, up to a day) is unsupported. Every
    value was refused."""
    body = {"model": "m", "messages": CHAT}
    check("CreateChatCompletionRequest", {**body, "prompt_cache_retention": "in_memory"})
    assert parse_body(requests.ChatCompletionRequest, json.dumps({**body, "prompt_cache_retention": "in_memory"}))
    with pytest.raises(APIError) as refused:
        parse_body(requests.ChatCompletionRequest, json.dumps({**body, "prompt_cache_retention": "24h"}))
    error = refused.value.body.error
    assert (refused.value.status, error.param, error.code) == (400, "prompt_cache_retention", "unsupported_parameter")
