"""OpenAI's service_tier and rate limits at the gateway, with the official SDK: a request's
service_tier picks its jobs' lane and the answer echoes the lane that served it (validated against
the spec); each API key is a tenant, whose rate limits (`mili quota set`) hold across every
gateway on the Redis at once: past them a 429 `rate_limit_exceeded` with Retry-After, which the
SDK's retries honour, and the x-ratelimit-* headers on every answer to the key."""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest

from gateway.api_keys import tenant_id
from gateway.rate_headers import RATE_HEADERS_TIMEOUT_S
from producer_client import Client
from producer_client.keys import Keys
from tests.gateway.support import ECHO_QUEUE
from tests.openai_spec import check, spec_text
from tests.support.gateways import GatewayProcess
from worker.embedded_redis import EmbeddedRedis, free_port

KEY_PLAIN, KEY_RPM, KEY_SDK, KEY_CHOICES = "lanes-plain-key", "lanes-rpm-key", "lanes-sdk-key", "lanes-n-key"
KEY_TOKENS = "lanes-tokens-key"
RPM = 3
CHOICES_TPM = 600  # a token drips back every 100 ms: a few jobs' tokens stay counted for seconds
# A request drips back every 5 s: an emptied bucket refuses the tenant's requests that long, many
# times what a request takes on a loaded machine (at 0.5 s, CI's first request came after the drip
# and was admitted), and the SDK's retry waits that long.
SDK_RPM = 12
CHAT = [{"role": "user", "content": "lanes"}]


@pytest.fixture(scope="module")
def two_gateways(redis_server, gateway_workers, tmp_path_factory):
    """Two gateways on the session's Redis and workers, with the same keys."""
    client = Client(redis_server.url, ECHO_QUEUE)
    client.tenant_quotas.set(tenant_id(KEY_RPM), rpm=RPM, tpm=100_000)
    client.tenant_quotas.set(tenant_id(KEY_SDK), rpm=SDK_RPM)
    client.tenant_quotas.set(tenant_id(KEY_CHOICES), rpm=RPM, tpm=CHOICES_TPM)
    client.tenant_quotas.set(tenant_id(KEY_TOKENS), tpm=CHOICES_TPM)
    keys = json.dumps([KEY_PLAIN, KEY_RPM, KEY_SDK, KEY_CHOICES, KEY_TOKENS])
    log_dir = tmp_path_factory.mktemp("lanes")
    gateways = [GatewayProcess(redis_server.url, log_dir, "--api-keys", keys, name=f"gw-{i}") for i in (1, 2)]
    try:
        yield [g.start() for g in gateways]
    finally:
        for g in gateways:
            g.stop()
        for key in (KEY_RPM, KEY_SDK, KEY_CHOICES, KEY_TOKENS):
            client.tenant_quotas.set(tenant_id(key), unset=("rpm", "tpm"))
        client.close()


def sdk_for(gateway: GatewayProcess, key: str, retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=retries)


@pytest.mark.parametrize(
    ("asked", "served"), [("priority", "priority"), ("flex", "flex"), ("auto", "default"), (None, "default")]
)
def test_service_tier_picks_the_lane_and_the_answer_echoes_it(sdk, redis_client, asked, served):
    raw = sdk.chat.completions.with_raw_response.create(
        model="echo", messages=CHAT, max_tokens=4, **({"service_tier": asked} if asked else {})
    )
    body = json.loads(raw.http_response.text)
    check("CreateChatCompletionResponse", body)
    assert body["service_tier"] == raw.parse().service_tier == served
    lane_streams = redis_client.smembers(Keys().lane_streams(ECHO_QUEUE))
    assert served == "default" or f"{served}:-" in lane_streams  # an open gateway's jobs are no tenant's


def test_a_streamed_answer_echoes_the_lane_in_every_chunk(sdk):
    stream = sdk.chat.completions.create(
        model="echo",
        messages=CHAT,
        max_tokens=4,
        service_tier="flex",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk.model_dump(mode="json", exclude_unset=True) for chunk in stream]
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    assert [chunk["service_tier"] for chunk in chunks] == ["flex"] * len(chunks)


def test_fast_runs_in_the_priority_lane_and_the_answer_says_priority_as_the_spec_says(sdk, redis_client):
    """The spec's ServiceTier: `fast` opts in to what `priority` does, and the answer shows
    `priority` either way. MILI runs a priority lane: `fast` was a 400 unsupported_parameter."""
    rule = spec_text("/components/schemas/ServiceTier/anyOf/0/description")
    assert "The response will show `service_tier=priority` regardless of if you specify `service_tier=fast`" in rule
    whole = sdk.chat.completions.with_raw_response.create(
        model="echo", messages=CHAT, max_tokens=4, service_tier="fast"
    )
    body = json.loads(whole.http_response.text)
    check("CreateChatCompletionResponse", body)
    assert body["service_tier"] == "priority"
    assert "priority:-" in redis_client.smembers(Keys().lane_streams(ECHO_QUEUE))  # an open gateway's: no tenant's
    stream = sdk.chat.completions.create(model="echo", messages=CHAT, max_tokens=4, service_tier="fast", stream=True)
    chunks = [chunk.model_dump(mode="json", exclude_unset=True) for chunk in stream]
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk)
    assert [chunk["service_tier"] for chunk in chunks] == ["priority"] * len(chunks)


def test_an_api_keys_jobs_are_its_tenants_in_their_lane(two_gateways, redis_client):
    answer = sdk_for(two_gateways[0], KEY_PLAIN).chat.completions.create(
        model="echo", messages=CHAT, max_tokens=4, service_tier="priority"
    )
    assert answer.service_tier == "priority"
    assert f"priority:{tenant_id(KEY_PLAIN)}" in redis_client.smembers(Keys().lane_streams(ECHO_QUEUE))


def limit_headers(response: httpx.Response) -> dict[str, str]:
    return {name: value for name, value in response.headers.items() if name.startswith("x-ratelimit-")}


def test_a_tenants_rate_limit_holds_across_gateways_with_openais_429_and_headers(two_gateways):
    """RPM requests pass, alternating between the two gateways; the next is refused by either,
    and nothing else is admitted however often it is tried within the minute."""
    sdks = [sdk_for(g, KEY_RPM) for g in two_gateways]
    answers = [
        sdks[i % 2].chat.completions.with_raw_response.create(model="echo", messages=CHAT, max_tokens=4)
        for i in range(RPM)
    ]
    assert [a.headers["x-ratelimit-limit-requests"] for a in answers] == [str(RPM)] * RPM
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == [str(RPM - 1 - i) for i in range(RPM)]
    assert all(a.headers["x-ratelimit-limit-tokens"] == "100000" for a in answers)
    for sdk in sdks:
        with pytest.raises(openai.RateLimitError) as refused:
            sdk.chat.completions.create(model="echo", messages=CHAT, max_tokens=4)
        error = refused.value
        check("ErrorResponse", error.response.json())
        assert (error.code, error.type) == ("rate_limit_exceeded", "requests")
        retry_after_ms = int(error.response.headers["retry-after-ms"])
        assert 0 < retry_after_ms <= 60_000 / RPM
        assert error.response.headers["retry-after"] == str(-(-retry_after_ms // 1000))
        assert limit_headers(error.response)["x-ratelimit-remaining-requests"] == "0"
        assert re.fullmatch(r"\d+(\.\d+)?s|\d+ms", error.response.headers["x-ratelimit-reset-requests"])
    models = httpx.get(f"{two_gateways[1].url}/v1/models", headers={"Authorization": f"Bearer {KEY_RPM}"})
    # An answer that enqueues nothing counts nothing and says the limits on the default queue (the
    # limits hold per queue, as OpenAI's per model): untouched there.
    assert models.status_code == 200
    assert (
        limit_headers(models)["x-ratelimit-limit-requests"],
        limit_headers(models)["x-ratelimit-remaining-requests"],
    ) == (str(RPM), str(RPM))
    plain = httpx.get(f"{two_gateways[1].url}/v1/models", headers={"Authorization": f"Bearer {KEY_PLAIN}"})
    assert limit_headers(plain) == {}  # a tenant with no limits


def test_the_edges_refusals_of_a_limited_tenant_carry_its_rate_limit_headers(two_gateways):
    """Every answer to the tenant: a 415 and the two 413s (announced, and a chunked body cut off
    past max_json_bytes) the edge answers before any route; a wrong key is no tenant's and gets
    none. Each counts nothing (no request was enqueued)."""
    url = f"{two_gateways[0].url}/v1/chat/completions"
    key = {"Authorization": f"Bearer {KEY_RPM}"}
    too_big = 4 * 1024 * 1024 + 1  # max_json_bytes' default, and a byte

    def chunked():
        yield b" " * too_big

    answers = {
        415: httpx.post(url, headers={**key, "content-type": "text/plain"}, content=b"{}"),
        413: httpx.post(url, headers={**key, "content-type": "application/json"}, content=b" " * too_big),
        "413 chunked": httpx.post(url, headers={**key, "content-type": "application/json"}, content=chunked()),
    }
    for status, answer in answers.items():
        assert answer.status_code == int(str(status)[:3])
        assert (
            limit_headers(answer)["x-ratelimit-limit-requests"],
            limit_headers(answer)["x-ratelimit-limit-tokens"],
        ) == (
            str(RPM),
            "100000",
        ), status
    wrong = httpx.post(url, headers={"Authorization": "Bearer wrong", "content-type": "text/plain"}, content=b"{}")
    assert (wrong.status_code, limit_headers(wrong)) == (401, {})


def test_a_request_with_n_choices_counts_one_request_and_every_choices_tokens(two_gateways, redis_client):
    """As OpenAI counts them: n=3 is one request against the requests-per-minute limit and three
    jobs' tokens against the tokens-per-minute one (read from the tenant's GCRA state: each
    request moves its requests' arrival time by 60000/RPM ms, its tokens' by 60000/TPM ms per
    token). Past the requests' limit an n=3 request is refused whole: nothing more is counted."""
    sdk = sdk_for(two_gateways[0], KEY_CHOICES)
    rate = Keys().rate(ECHO_QUEUE, tenant_id(KEY_CHOICES))
    answers, tats = [], []
    for n in (1, 1, 3):
        answers.append(sdk.chat.completions.with_raw_response.create(model="echo", messages=CHAT, max_tokens=4, n=n))
        tats.append([float(v) for v in redis_client.hmget(rate, "r", "t")])
    assert [len(a.parse().choices) for a in answers] == [1, 1, 3]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["2", "1", "0"]
    (r1, t1), (r2, t2), (r3, t3) = tats
    assert (r2 - r1, r3 - r2) == (60_000 / RPM, 60_000 / RPM)
    one_job_ms = t2 - t1  # the same request's job, counted while the bucket still held the first's
    assert one_job_ms > 0 and one_job_ms % (60_000 / CHOICES_TPM) == 0
    assert t3 - t2 == pytest.approx(3 * one_job_ms, abs=0.002)
    with pytest.raises(openai.RateLimitError) as refused:
        sdk.chat.completions.create(model="echo", messages=CHAT, max_tokens=4, n=3)
    assert refused.value.type == "requests"
    assert [float(v) for v in redis_client.hmget(rate, "r", "t")] == [r3, t3]


def test_a_request_whose_choices_tokens_do_not_fit_is_refused_whole_with_nothing_enqueued(
    two_gateways, redis_client, redis_server
):
    """A request counts every choice's tokens, so they are counted at once: one whose choices
    together pass what the tenant's bucket holds now is a 429 with nothing enqueued or counted, and
    one whose choices pass the limit itself, which no wait lets in, a 400 as a single job's (not a
    429 the SDK retries). Each choice alone fits: the first went in, was counted and ran, and only
    the second was refused (each retry took the first's tokens again). Token ids as the prompt, so
    that a job's tokens are exactly 3 + max_tokens; a token drips back every 100 ms."""
    tenant = tenant_id(KEY_TOKENS)
    rate, jobs = Keys().rate(ECHO_QUEUE, tenant), Keys().job(f"{tenant}.*")

    def request(n: int, max_tokens: int) -> httpx.Response:
        body = {"model": "echo", "prompt": [1, 2, 3], "max_tokens": max_tokens, "n": n}
        return httpx.post(
            f"{two_gateways[0].url}/v1/completions",
            headers={"Authorization": f"Bearer {KEY_TOKENS}"},
            json=body,
            timeout=30,
        )

    never = request(2, 397)  # 2 x 400 tokens against 600
    assert (never.status_code, never.json()["error"]["code"], never.json()["error"]["param"]) == (
        400,
        "invalid_value",
        "max_tokens",
    ), never.text
    assert redis_client.hmget(rate, "r", "t") == [None, None] and list(redis_client.scan_iter(jobs)) == []
    with Client(redis_server.url, ECHO_QUEUE, tenant=tenant) as producer:
        producer.wait(producer.submit(input_ids=[1, 2, 3], max_tokens=397))  # 400 of the 600 taken
    counted, kept = redis_client.hmget(rate, "r", "t"), set(redis_client.scan_iter(jobs))
    not_now = request(2, 147)  # 2 x 150 against the 200 left (and the few dripped back since)
    assert (not_now.status_code, not_now.json()["error"]["type"]) == (429, "tokens"), not_now.text
    assert "x-mili-job-ids" not in not_now.headers
    assert redis_client.hmget(rate, "r", "t") == counted and set(redis_client.scan_iter(jobs)) == kept
    fits = request(2, 47)  # 2 x 50: in, both counted at once
    assert [c["text"] for c in fits.json()["choices"]] == ["\x01\x02\x03"] * 2, fits.text  # the echo of the ids
    assert float(redis_client.hget(rate, "t")) - float(counted[1]) == 100 * 60_000 / CHOICES_TPM


def test_the_sdks_retry_waits_out_the_reset_and_is_admitted(two_gateways, redis_server):
    """The bucket emptied by a producer of the same tenant (the limits are the tenant's, on every
    gateway and producer): the SDK's one retry, after retry-after-ms, gets in."""
    with Client(redis_server.url, ECHO_QUEUE, tenant=tenant_id(KEY_SDK)) as producer:
        producer.submit_many([{"prompt": "x", "max_tokens": 1}] * SDK_RPM)
    with pytest.raises(openai.RateLimitError):
        sdk_for(two_gateways[0], KEY_SDK).chat.completions.create(model="echo", messages=CHAT, max_tokens=4)
    raw = sdk_for(two_gateways[1], KEY_SDK, retries=1).chat.completions.with_raw_response.create(
        model="echo", messages=CHAT, max_tokens=4
    )
    answer = raw.parse()
    assert raw.retries_taken == 1  # refused first: admitted by the retry
    assert (answer.choices[0].finish_reason, answer.usage.completion_tokens) == ("length", 4)


def test_a_limited_tenants_answers_do_not_wait_on_an_unreachable_redis_for_their_headers(tmp_path):
    """The headers are read from Redis for every answer to a tenant with limits; while Redis was
    away that read waited out the client's retries (7 s on this machine), so even a 404 that
    needs no Redis took that long, and a refused request twice that. The read is bounded: the
    answer goes out without the headers, as after any failed read."""
    with EmbeddedRedis(port=free_port()) as server:
        with Client(server.url) as client:
            client.tenant_quotas.set(tenant_id(KEY_RPM), rpm=RPM)
        gateway = GatewayProcess(server.url, tmp_path, "--api-keys", json.dumps([KEY_RPM])).start()
    try:  # Redis is gone from here on
        started = time.monotonic()
        answer = httpx.get(
            f"{gateway.url}/v1/no-such-route", headers={"Authorization": f"Bearer {KEY_RPM}"}, timeout=60
        )
        elapsed = time.monotonic() - started
    finally:
        gateway.stop()
    assert answer.status_code == 404 and limit_headers(answer) == {}
    assert elapsed < 4 * RATE_HEADERS_TIMEOUT_S, elapsed
