"""Restarting the gateway loses no job: a stopping gateway cancels nothing, and a client that
retries with the same Idempotency-Key gets the result of the same job, which ran once."""

import threading
import time
import uuid

import openai
import pytest

from producer_client import Client
from producer_client.keys import Keys
from tests.gateway.support import TINY_QUEUE
from tests.support.gateways import GatewayProcess
from tests.support.jobs import runs

GREEDY = {"model": "tiny", "prompt": "Once upon a time", "temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def own_gateway(redis_server, gateway_workers, tmp_path):
    """A gateway of the test's own, which the test stops and starts again on the same port."""
    gw = GatewayProcess(redis_server.url, tmp_path)
    yield gw.start()
    gw.stop()


@pytest.fixture
def queue_client(redis_server):
    client = Client(redis_server.url, TINY_QUEUE)
    yield client
    client.close()


def jobs_of(queue_client, key: str) -> list[str]:
    return queue_client.redis.keys(Keys().job(f"{key}*"))


def test_a_stream_cut_by_a_restart_is_served_again_from_the_same_job(own_gateway, queue_client):
    sdk = openai.OpenAI(base_url=f"{own_gateway.url}/v1", api_key="unused", max_retries=0)
    key = uuid.uuid4().hex
    headers = {"Idempotency-Key": key}
    received = ""
    with pytest.raises(openai.APIError) as cut:
        for i, chunk in enumerate(sdk.completions.create(**GREEDY, max_tokens=150, stream=True, extra_headers=headers)):
            received += chunk.choices[0].text
            if i == 5:
                own_gateway.terminate()  # SIGTERM: the stream ends with a retryable error
    assert cut.value.body["code"] == "gateway_stopping"
    assert "Application shutdown complete." in own_gateway.log()  # a graceful stop, not a crash
    assert queue_client.status(f"{key}-0").status == "running"  # the stop cancelled nothing

    own_gateway.start()
    retried = "".join(
        c.choices[0].text for c in sdk.completions.create(**GREEDY, max_tokens=150, stream=True, extra_headers=headers)
    )
    result = queue_client.result(f"{key}-0", timeout=30)
    assert retried == result.text and retried.startswith(received) and len(received) < len(retried)
    assert result.usage.completion_tokens == 150
    assert len(runs(queue_client.redis, f"{key}-0")) == 1  # one run: the job never stopped
    assert jobs_of(queue_client, key) == [Keys().job(f"{key}-0")]
    sdk.close()


def test_the_sdk_retries_a_request_cut_by_a_killed_gateway_onto_the_same_job(own_gateway, queue_client):
    sdk = openai.OpenAI(base_url=f"{own_gateway.url}/v1", api_key="unused", max_retries=8)
    key = uuid.uuid4().hex

    def kill_and_restart():
        time.sleep(0.5)  # the request is waiting for its job
        own_gateway.kill()
        own_gateway.start()

    restarter = threading.Thread(target=kill_and_restart)
    restarter.start()
    raw = sdk.completions.with_raw_response.create(**GREEDY, max_tokens=100, extra_headers={"Idempotency-Key": key})
    restarter.join()
    answer = raw.parse()
    result = queue_client.result(f"{key}-0", timeout=30)
    assert raw.retries_taken >= 1
    assert raw.headers["x-mili-job-ids"] == f"{key}-0"
    assert answer.id == f"cmpl-{key}"
    assert answer.choices[0].text == result.text and answer.usage.completion_tokens == 100
    assert len(runs(queue_client.redis, f"{key}-0")) == 1
    assert jobs_of(queue_client, key) == [Keys().job(f"{key}-0")]
    sdk.close()
