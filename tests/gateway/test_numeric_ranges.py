"""Every numeric sampling argument is range-checked at each edge, by the wire models all three
share: a number out of range (top_k of 2**63, a token id past int32, a seed of 2**64) is an
InvalidArgument from the client before anything is enqueued, a 400 from the gateway with nothing
enqueued, and an `invalid_argument` failure from the worker for an entry written by hand, which
serves on. On main a top_k of 2**63 went through to the engine and failed inside a step."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from harness.polling import eventually
from producer_client import Client, InvalidArgument, JobFailed
from producer_client.keys import PROTOCOL_VERSION, Keys
from tests.gateway.support import ECHO_QUEUE
from tests.support.jobs import job_ids

OUT_OF_RANGE = [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 1e308}, "repetition_penalty"),
    ({"min_tokens": 2**63}, "min_tokens"),
]
# OpenAI's code for each, at the gateway: a number past a bound by its kind, an integer's or a
# decimal's (it answered above_max_value, a code of MILI's own); a token id past int32 is no
# bound of a field's number but of its list's items, and min_tokens is refused as more than
# max_tokens, a rule between two fields.
GATEWAY_CODES = {
    "top_k": "integer_above_max_value",
    "stop_token_ids": "invalid_value",
    "seed": "integer_above_max_value",
    "min_p": "decimal_above_max_value",
    "repetition_penalty": "decimal_above_max_value",
    "min_tokens": "invalid_value",
}


@pytest.mark.parametrize("sampling, field", OUT_OF_RANGE)
def test_the_client_refuses_it_before_anything_is_enqueued(redis_server, redis_client, sampling, field):
    before = job_ids(redis_client)
    with Client(redis_server.url, ECHO_QUEUE) as client, pytest.raises(InvalidArgument) as e:
        client.submit(prompt="x", max_tokens=4, **sampling)
    assert e.value.field == field and job_ids(redis_client) <= before


@pytest.mark.parametrize("sampling, field", OUT_OF_RANGE)
def test_the_gateway_answers_400_and_enqueues_nothing(gateway, redis_client, sampling, field):
    before = job_ids(redis_client)
    response = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": "echo", "prompt": "x", "max_tokens": 4, **sampling}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (GATEWAY_CODES[field], field), error
    assert job_ids(redis_client) <= before


# A bound the client library checks answers as one the gateway's request model checks; a NaN or an
# infinity (which Python's json writes and pydantic reads) is no number of any range.
BOUND_CODES = [
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens", "integer_below_min_value"),
    ("/v1/completions", {"max_tokens": 10**6}, "max_tokens", "integer_above_max_value"),
    ("/v1/completions", {"top_k": -1}, "top_k", "integer_below_min_value"),
    ("/v1/completions", {"min_p": 2}, "min_p", "decimal_above_max_value"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty", "decimal_below_min_value"),
    ("/v1/completions", {"temperature": float("nan")}, "temperature", "invalid_value"),
    ("/v1/chat/completions", {"top_p": float("inf")}, "top_p", "invalid_value"),
]


@pytest.mark.parametrize("path, sampling, field, code", BOUND_CODES)
def test_a_bound_is_answered_with_openais_code_for_it_whoever_checks_it(gateway, path, sampling, field, code):
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    response = httpx.post(
        f"{gateway.url}{path}",
        content=json.dumps({"model": "echo", **prompt, **sampling}),
        headers={"content-type": "application/json"},
    )
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, code, field), error
    assert code != "invalid_value" or error["message"] == f"{field}: Input should be a finite number"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_the_client_refuses_a_number_that_is_not_finite_as_such(redis_server, value):
    with Client(redis_server.url, ECHO_QUEUE) as client:
        for field in ("temperature", "top_p", "presence_penalty", "timeout_s"):
            with pytest.raises(InvalidArgument) as e:
                client.submit(prompt="x", **{field: value})
            assert e.value.message == f"{field}: Input should be a finite number"


def test_a_token_id_past_int32_in_a_prompt_is_refused_too(redis_server, gateway):
    with Client(redis_server.url, ECHO_QUEUE) as client, pytest.raises(InvalidArgument) as e:
        client.submit(input_ids=[1, 2**63], max_tokens=4)
    assert e.value.field == "input_ids"
    response = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": "echo", "prompt": [1, 2**63], "max_tokens": 4}
    )
    assert response.status_code == 400


def test_the_worker_fails_a_hand_written_entry_and_serves_on(redis_server, redis_client, gateway_workers):
    with Client(redis_server.url, ECHO_QUEUE) as client:
        bad = {}
        for sampling, field in OUT_OF_RANGE:
            job_id = f"range-{uuid.uuid4().hex}"
            body = json.dumps({"prompt": "x", "params": {"max_tokens": 4, **sampling}})
            redis_client.xadd(Keys().queue(ECHO_QUEUE), {"id": job_id, "v": str(PROTOCOL_VERSION), "body": body})
            bad[job_id] = field
        for job_id, field in bad.items():
            assert eventually(lambda: redis_client.exists(Keys().job(job_id)), timeout=30)  # noqa: B023 (no client created it)
            with pytest.raises(JobFailed) as e:
                client.result(job_id, timeout=30)
            assert e.value.code == "invalid_argument" and field in e.value.message
        assert client.generate(prompt="next", max_tokens=8, timeout=30).text == "next"
