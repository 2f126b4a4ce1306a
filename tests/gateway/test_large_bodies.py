"""Large request bodies, up to the gateway's `max_json_bytes` (4 MiB): one is validated and made
into jobs without holding every other request for as long (the event loop answers /health
meanwhile), and its refusals are OpenAI's typed errors, naming their field."""

import json
import warnings

import httpx
import openai
import pytest

from gateway.app import Gateway
from gateway.settings import GatewaySettings
from openai_format.job_specs import JobSpec, chat_jobs, parse_body
from openai_format.requests import ChatCompletionRequest
from producer_client.new_job import NewJob
from tests.support.gateways import slowest_answer_while

USER = {"role": "user", "content": "a"}


def test_a_body_of_many_messages_holds_no_other_request(gateway):
    """120,000 messages (4 MiB): their validation held the event loop, so every other client's
    request (and /health, whose Redis PING then missed its 0.5 s and answered 503) for the whole
    0.5-2.4 s of it, only for the job's body to be refused as over 1 MiB. Now the body is validated
    on a thread and the messages refused by their count before the job is built: /health answers
    meanwhile, held only by the parse of the JSON itself (tens of milliseconds a MiB). The body is
    made before the clock runs (the SDK's own preparation of so many messages takes seconds)."""
    body = json.dumps({"model": "echo", "messages": [USER] * 120_000, "max_tokens": 1}).encode()
    assert len(body) <= GatewaySettings().max_json_bytes

    def send() -> httpx.Response:
        headers = {"content-type": "application/json"}
        return httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=headers, timeout=120)

    answer, took, slowest = slowest_answer_while(gateway.url, send)
    assert isinstance(answer, httpx.Response) and answer.status_code == 400, answer
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == ("body_too_large", "body"), error
    # On the loop, /health waited for nearly all of the request (measured: its whole time, 0.5-4 s).
    assert slowest < took / 3, (slowest, took)


def test_an_sdk_users_messages_too_many_for_a_jobs_body_are_refused_as_such(sdk):
    """As the SDK raises it: 40,000 messages cannot fit the 1 MiB of a job's body, refused before
    they are validated as a job's."""
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(model="echo", messages=[USER] * 40_000, max_tokens=1)
    assert refused.value.code == "body_too_large" and refused.value.param == "body", refused.value.body
    assert "40000 messages take at least" in refused.value.message


@pytest.mark.parametrize("seed", [None, 7])
def test_the_equal_jobs_of_a_requests_choices_are_checked_once(monkeypatch, seed):
    """n=128 choices of one long prompt were 128 equal jobs, each validated on the event loop by the
    request's check (130 ms each for 33,000 messages: 17 s, every other request held meanwhile).
    Equal jobs (no seed) are checked once, and counted as many times; seeded ones differ, and each
    is checked."""
    checked = []
    check = JobSpec.check

    def counted(spec: JobSpec, *args) -> NewJob:
        checked.append(spec)
        return check(spec, *args)

    monkeypatch.setattr(JobSpec, "check", counted)
    body = {"model": "m", "messages": [USER] * 1_000, "n": 128, "max_tokens": 1, "seed": seed}
    specs = chat_jobs(parse_body(ChatCompletionRequest, json.dumps(body)))
    gateway = Gateway.__new__(Gateway)  # check() reads the settings' job_timeout_s only
    gateway.settings = GatewaySettings()
    tokens = gateway.check(specs, stream=False)
    assert len(checked) == (1 if seed is None else 128)
    assert tokens == sum(check(spec, gateway.settings.job_timeout_s).cost for spec in specs)


@pytest.mark.parametrize(
    ("field", "value", "param", "code"),
    [
        ("n", "9" * 5_000, "n", "integer_above_max_value"),
        ("seed", "-" + "9" * 4_301, "seed", "integer_below_min_value"),
        ("stop_token_ids", "[1, " + "7" * 10_000 + "]", "stop_token_ids.1", "integer_above_max_value"),
    ],
    ids=["n", "seed", "stop_token_ids"],
)
def test_an_integer_of_more_than_4300_digits_is_refused_naming_its_field(gateway, field, value, param, code):
    """Python converts no integer of more than 4,300 digits (CVE-2020-10735), and the JSON parser
    refused such a body as `invalid_json`, naming nothing. It is now the bound's error of the field
    that holds it. (An SDK cannot send one: its own json.dumps refuses it; a raw body can.)"""
    body = f'{{"model": "echo", "messages": [{{"role": "user", "content": "a"}}], "{field}": {value}}}'
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code), error
    assert "4300" in error["message"], error


def test_a_body_invalid_besides_its_long_integer_is_still_invalid_json(gateway):
    body = '{"model": "echo", "n": ' + "9" * 5_000 + ","
    answer = httpx.post(
        f"{gateway.url}/v1/chat/completions", content=body, headers={"content-type": "application/json"}, timeout=60
    )
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["code"] == "invalid_json" and answer.json()["error"]["param"] is None


def test_a_chat_requests_fingerprint_serializes_its_messages_without_a_warning():
    """An Idempotency-Key's digest serializes the request: its messages' union found no member by
    a tag read of a dict alone, and pydantic warned once for each message (0.8 s for 140,000 on
    the event loop, before any key was looked at)."""
    messages = [
        {"role": "developer", "content": "d"},
        {"role": "user", "content": [{"type": "text", "text": "u"}]},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": ""}}],
        },
        {"role": "tool", "content": "r", "tool_call_id": "c"},
    ]
    request = parse_body(ChatCompletionRequest, json.dumps({"model": "m", "messages": messages}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dumped = request.model_dump_json(exclude_none=True)
    assert json.loads(dumped)["messages"] == messages
