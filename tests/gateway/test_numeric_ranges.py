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
from tests.support.jobs import job_count

OUT_OF_RANGE = [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 2**31}, "top_k"),
    ({"stop_token_ids": [2**40]}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 1e308}, "repetition_penalty"),
    ({"min_tokens": 2**63}, "min_tokens"),
]


@pytest.mark.parametrize("sampling, field", OUT_OF_RANGE)
def test_the_client_refuses_it_before_anything_is_enqueued(redis_server, redis_client, sampling, field):
    before = job_count(redis_client)
    with Client(redis_server.url, ECHO_QUEUE) as client, pytest.raises(InvalidArgument) as e:
        client.submit(prompt="x", max_tokens=4, **sampling)
    assert e.value.field == field and job_count(redis_client) == before


@pytest.mark.parametrize("sampling, field", OUT_OF_RANGE)
def test_the_gateway_answers_400_and_enqueues_nothing(gateway, redis_client, sampling, field):
    before = job_count(redis_client)
    response = httpx.post(
        f"{gateway.url}/v1/completions", json={"model": "echo", "prompt": "x", "max_tokens": 4, **sampling}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] in ("invalid_value", "above_max_value") and error["param"] == field, error
    assert job_count(redis_client) == before


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
