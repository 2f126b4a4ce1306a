"""A client that gives up frees its place: with the official SDK and a timeout, on a queue no
worker serves, the gateway cancels the requests' jobs when their clients leave, and the key's
waiting quota (`mili quota set --max-waiting`) and the queue's bound count them no more, so later
requests are accepted (they wait), not refused with a 429."""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from gateway.api_keys import tenant_id
from harness.polling import eventually
from producer_client import Client
from tests.support.gateways import GatewayProcess
from tests.support.jobs import job_ids_in_queue

KEY = "cancel-frees-key"
MAX_WAITING = 2
CHAT = [{"role": "user", "content": "wait"}]
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def parked(redis_server, tmp_path_factory):
    """A gateway with one key, whose tenant may have MAX_WAITING jobs waiting, and a model whose
    queue no worker serves (bound MAX_WAITING too)."""
    queue = f"gw-cancel-{uuid.uuid4().hex[:8]}"
    with Client(redis_server.url, queue) as admin:
        admin.tenant_quotas.set(tenant_id(KEY), max_waiting=MAX_WAITING)
    gw = GatewayProcess(
        redis_server.url,
        tmp_path_factory.mktemp("cancel-frees"),
        "--api-keys",
        json.dumps([KEY]),
        "--max-queue-depth",
        str(MAX_WAITING),
        "--models",
        json.dumps({"waiting": queue}),
    )
    gw.queue = queue
    yield gw.start()
    gw.stop()


def test_requests_whose_clients_timed_out_free_the_keys_waiting_quota(parked, redis_client):
    """While MAX_WAITING requests wait, the next is a 429; once their clients time out, the
    gateway's cancels free their places, round after round."""
    sdk = openai.OpenAI(base_url=f"{parked.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT_S)
    patient = sdk.with_options(timeout=4 * TIMEOUT_S)
    try:
        with ThreadPoolExecutor(MAX_WAITING) as pool:
            waiting = [
                pool.submit(patient.chat.completions.create, model="waiting", messages=CHAT, max_tokens=4)
                for _ in range(MAX_WAITING)
            ]
            assert eventually(lambda: len(job_ids_in_queue(redis_client, parked.queue)) == MAX_WAITING)
            with pytest.raises(openai.RateLimitError):  # the quota is full
                sdk.chat.completions.create(model="waiting", messages=CHAT, max_tokens=4)
            for request in waiting:
                with pytest.raises(openai.APITimeoutError):
                    request.result()
        for round_ in range(3):  # each round fills the quota, times out, and is cancelled
            for _ in range(MAX_WAITING):
                with pytest.raises(openai.APITimeoutError):  # accepted: it waits, and the SDK gives up
                    sdk.chat.completions.create(model="waiting", messages=CHAT, max_tokens=4)
            assert eventually(lambda: job_ids_in_queue(redis_client, parked.queue) == [], timeout=15), round_
        with pytest.raises(openai.APITimeoutError):
            sdk.chat.completions.create(model="waiting", messages=CHAT, max_tokens=4)
    finally:
        sdk.close()
