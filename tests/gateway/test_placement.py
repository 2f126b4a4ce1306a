"""Cache-aware placement through the gateway (docs/architecture.md), with the official openai SDK:
two echo worker processes serve one queue, and every turn of a conversation runs on one worker,
placed on its own stream; /metrics counts the jobs placed each way. `--no-placement` sends every
job to the shared stream."""

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.polling import eventually
from producer_client import Client
from producer_client.placement import REFRESH_S
from tests.support.gateways import GatewayProcess
from tests.support.workers import echo_workers

pytestmark = pytest.mark.waits

MODEL = "placed"
TURNS = 3
CONVERSATIONS = 4


def placed_counts(gateway: GatewayProcess) -> dict[str, float]:
    families = text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text)
    return {
        s.labels["placement"]: s.value
        for f in families
        if f.name == "mili_gateway_jobs_placed"
        for s in f.samples
        if s.name == "mili_gateway_jobs_placed_total"
    }


def converse(sdk: openai.OpenAI, client: Client) -> dict[int, set[str]]:
    """Each conversation's turns, one after another; returns the workers each one ran on. Between
    rounds the gateway's view of the workers goes stale and is read again, with every worker idle:
    each round places as the first did."""
    ran_on: dict[int, set[str]] = {i: set() for i in range(CONVERSATIONS)}
    histories = {i: [{"role": "system", "content": f"conversation {i} of the placement test"}] for i in ran_on}
    for turn in range(TURNS):
        for i, history in histories.items():
            history.append({"role": "user", "content": f"turn {turn}"})
            raw = sdk.chat.completions.with_raw_response.create(model=MODEL, messages=history, max_tokens=4)
            history.append({"role": "assistant", "content": raw.parse().choices[0].message.content})
            ran_on[i].add(client.result(raw.headers["x-mili-job-ids"], timeout=10).worker)
        time.sleep(REFRESH_S + 0.2)
    return ran_on


@pytest.mark.parametrize("placement", [True, False], ids=["placement", "no-placement"])
def test_a_conversation_through_the_gateway_stays_on_one_worker(redis_server, tmp_path, placement):
    queue = f"gw-placed-{placement}"
    flags = ["--models", json.dumps({MODEL: queue}), "--workers-refresh-s", "0.2"]
    flags.append("--placement" if placement else "--no-placement")
    with echo_workers(redis_server.url, queue, tmp_path, count=2) as workers, Client(redis_server.url, queue) as client:
        gateway = GatewayProcess(redis_server.url, tmp_path, *flags).start()
        try:
            assert eventually(lambda: all(w.heartbeat().get("placement") == "1" for w in workers))
            sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
            ran_on = converse(sdk, client)
            jobs = TURNS * CONVERSATIONS
            if placement:
                assert all(len(names) == 1 for names in ran_on.values()), ran_on
                assert placed_counts(gateway) == {"affinity": jobs, "shared": 0}
            else:
                assert placed_counts(gateway) == {"affinity": 0, "shared": jobs}
        finally:
            gateway.stop()
