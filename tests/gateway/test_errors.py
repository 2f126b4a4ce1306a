"""Errors in OpenAI's shape, with the status codes the SDK maps, and bad input refused before
anything is enqueued. Plain httpx, so that the exact status, headers and body are checked."""

import json
import re
import socket
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api_keys import tenant_id
from gateway.batch.schema import CreateBatch
from gateway.errors import WWW_AUTHENTICATE, api_error_of
from gateway.rate_headers import RATE_HEADERS_TIMEOUT_S
from gateway.settings import GatewaySettings
from harness.polling import eventually
from openai_format.errors import APIError
from openai_format.job_specs import parse_body
from openai_format.requests import ChatCompletionRequest
from producer_client import Client
from producer_client.errors import RedisOutOfMemory, RedisReadOnly
from producer_client.keys import Keys
from tests.gateway.support import ECHO_QUEUE, PARKED_MODEL
from tests.openai_spec import check
from tests.support.gateways import GatewayProcess
from tests.support.jobs import job_ids, job_ids_in_queue
from worker.embedded_redis import EmbeddedRedis, free_port

pytestmark = pytest.mark.waits

CHAT = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
API_KEYS = ["key-one", "key-two"]
STRICT_TIMEOUT_S = 1.0
# A probe's timeout: /health must answer within it, whatever Redis does (health_timeout_s is 0.5 s).
HEALTH_TIMEOUT_S = 2.0
SILENT_HEALTH_TIMEOUT_S = 0.3
# Kubernetes' default probe timeoutSeconds: what a probe waits where a manifest sets none.
KUBERNETES_PROBE_TIMEOUT_S = 1.0
# The gateway runs on uvloop where installed (uvicorn takes it), whose timers count whole
# milliseconds of a clock read in whole milliseconds: a 0.5 s timeout fires up to 1 ms before 0.5 s
# of perf_counter have passed (20 ms timeouts: 10 of 200 at 19.3-19.9 ms, asyncio's loop none).
# A lower bound says the 503 waited its timeout, not that the loop's clock is finer than that.
LOOP_TIMER_SLACK_MS = 1.0


def error_of(response: httpx.Response) -> dict:
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert response.headers["x-request-id"]
    return body["error"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": CHAT}, "model"),
        ({"model": "tiny"}, "messages"),
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"model": "tiny", "messages": [{"content": "hi"}]}, "messages.0.role"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages.0.content",
        ),
        ({"model": "tiny", "messages": [{"role": "user"}]}, "messages.0.content"),
        ({"model": "tiny", "messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id"),
        ({"model": "tiny", "messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages.0.role"),
        (
            {"model": "tiny", "messages": [*CHAT, {"role": "assistant", "content": "x", "audio": {"id": "a"}}]},
            "messages.1.audio",
        ),
        ({"model": "tiny", "messages": CHAT, "temperature": "hot"}, "temperature"),
        ({"model": "tiny", "messages": CHAT, "temperature": -1}, "temperature"),
        ({"model": "tiny", "messages": CHAT, "temperature": 2.5}, "temperature"),
        ({"model": "tiny", "messages": CHAT, "top_p": 1.5}, "top_p"),
        ({"model": "tiny", "messages": CHAT, "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "messages": CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"model": "tiny", "messages": CHAT, "max_completion_tokens": 0, "n": 2}, "max_completion_tokens"),
        ({"model": "tiny", "messages": CHAT, "n": 0}, "n"),
        ({"model": "tiny", "messages": CHAT, "n": 129}, "n"),
        ({"model": "tiny", "messages": CHAT, "seed": 2**63}, "seed"),
        ({"model": "tiny", "messages": CHAT, "stop": [""]}, "stop"),
        ({"model": "tiny", "messages": CHAT, "stop": []}, "stop"),
        ({"model": "tiny", "messages": CHAT, "stop": ["x"] * 5}, "stop"),
        ({"model": "tiny", "messages": CHAT, "presence_penalty": 3}, "presence_penalty"),
        ({"model": "tiny", "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
        ({"model": "tiny", "messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"model": "tiny", "messages": CHAT, "min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"model": "tiny", "messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "tiny", "messages": CHAT, "tools": [{"type": "function"}]}, "tools.0.function"),
        (
            {"model": "tiny", "messages": CHAT, "tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools.0.function.name",
        ),
        ({"model": "tiny", "messages": CHAT, "tool_choice": "required"}, "tool_choice"),
        (
            {
                "model": "tiny",
                "messages": CHAT,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice",
        ),
        (
            {"model": "tiny", "messages": CHAT, "chat_template_kwargs": {"enable_thinking": "no"}},
            "chat_template_kwargs.enable_thinking",
        ),
        (
            {"model": "tiny", "messages": CHAT, "chat_template_kwargs": {"add_vision_id": True}},
            "chat_template_kwargs.add_vision_id",
        ),
        ({"model": "tiny", "messages": CHAT, "colour": "red"}, "colour"),
    ],
)
def test_a_bad_chat_argument_is_a_400_naming_it_and_enqueues_nothing(gateway, redis_client, body, param):
    before = job_ids(redis_client)
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body)
    error = error_of(response)
    assert response.status_code == 400, response.text
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert job_ids(redis_client) <= before


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny", "prompt": []}, "prompt"),
        ({"model": "tiny", "prompt": [[]]}, "prompt"),
        ({"model": "tiny", "prompt": [1, "two"]}, "prompt"),
        ({"model": "tiny", "prompt": [-1]}, "prompt"),
        ({"model": "tiny", "prompt": [[1], [2**31]]}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "logprobs": 6}, "logprobs"),
        ({"model": "tiny", "prompt": ["a"] * 65, "n": 2}, "n"),
    ],
)
def test_a_bad_completion_argument_is_a_400_naming_it_and_enqueues_nothing(gateway, redis_client, body, param):
    before = job_ids(redis_client)
    response = httpx.post(f"{gateway.url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert error_of(response)["param"] == param
    assert job_ids(redis_client) <= before


def test_a_body_that_is_not_json_is_a_400(gateway, redis_client):
    before = job_ids(redis_client)
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400 and error_of(response)["type"] == "invalid_request_error"
    assert job_ids(redis_client) <= before


def test_a_bad_idempotency_key_is_a_400(gateway, redis_client):
    before = job_ids(redis_client)
    response = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": "tiny", "messages": CHAT},
        headers={"Idempotency-Key": "{bad}"},
    )
    assert response.status_code == 400 and error_of(response)["param"] == "Idempotency-Key"
    assert job_ids(redis_client) <= before


def test_an_unknown_model_job_or_route_is_a_404(gateway, sdk):
    model = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "no-such-model", "messages": CHAT})
    job = httpx.get(f"{gateway.url}/v1/jobs/{uuid.uuid4().hex}")
    route = httpx.get(f"{gateway.url}/v1/no-such-route")
    assert (model.status_code, error_of(model)["code"], error_of(model)["param"]) == (404, "model_not_found", "model")
    assert (job.status_code, error_of(job)["code"]) == (404, "job_not_found")
    assert route.status_code == 404 and error_of(route)["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        sdk.models.retrieve("no-such-model")


@pytest.mark.parametrize(
    ("method", "path", "allowed"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("DELETE", "/v1/models/echo", "GET, HEAD"),
        ("PUT", "/generate", "POST"),
        ("POST", "/metrics", "GET, HEAD"),
        # A path of two routes: the router's Allow named the first one's alone (POST).
        ("PUT", "/v1/batches", "GET, POST, HEAD"),
        ("DELETE", "/v1/files", "GET, POST, HEAD"),
        ("GET", "/v1/batches/batch_x/cancel", "POST"),
    ],
)
def test_a_method_a_route_does_not_take_is_a_405_naming_those_it_takes(gateway, method, path, allowed):
    """HTTP requires a 405's Allow header (RFC 9110, 15.5.6), every method the path takes: HEAD
    with GET (gateway/head.py); the error is OpenAI's shape, naming the method, the path and what
    it takes, with a code to branch on as a 404's `unknown_url` (it said "Method Not Allowed", no code)."""
    response = httpx.request(method, f"{gateway.url}{path}")
    assert (response.status_code, response.headers.get("allow")) == (405, allowed)
    check("ErrorResponse", response.json())
    assert error_of(response) == {
        "message": f"Method not allowed: {method} {path} (this path takes {allowed})",
        "type": "invalid_request_error",
        "param": None,
        "code": "method_not_allowed",
    }


def test_the_request_id_is_the_clients_when_it_sends_a_usable_one(gateway):
    mine = httpx.get(f"{gateway.url}/health", headers={"x-request-id": "my-request-7"})
    bad = httpx.get(f"{gateway.url}/health", headers={"x-request-id": "{no}"})
    assert mine.headers["x-request-id"] == "my-request-7"
    assert bad.headers["x-request-id"] not in ("{no}", "")


@pytest.fixture(scope="module")
def strict_gateway(redis_server, gateway_workers, tmp_path_factory):
    """API keys, a queue depth of 2 and a job deadline of STRICT_TIMEOUT_S; two parked models on
    queues of their own that no worker serves."""
    suffix = uuid.uuid4().hex[:8]
    models = {PARKED_MODEL: f"gw-strict-{suffix}", "full": f"gw-full-{suffix}"}
    gw = GatewayProcess(
        redis_server.url,
        tmp_path_factory.mktemp("strict"),
        "--api-keys",
        json.dumps(API_KEYS),
        "--max-queue-depth",
        "2",
        "--job-timeout-s",
        str(STRICT_TIMEOUT_S),
        "--retry-after-s",
        "3",
        "--models",
        json.dumps(models),
    )
    gw.models = models
    yield gw.start()
    gw.stop()


def test_a_missing_or_wrong_api_key_is_a_401(strict_gateway):
    url = f"{strict_gateway.url}/v1/models"
    missing = httpx.get(url)
    wrong = httpx.get(url, headers={"Authorization": "Bearer key-three"})
    right = [httpx.get(url, headers={"Authorization": f"Bearer {k}"}) for k in API_KEYS]
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert error_of(missing)["code"] == error_of(wrong)["code"] == "invalid_api_key"
    # RFC 9110 11.6.1: a 401 names how to authenticate.
    assert missing.headers["www-authenticate"] == wrong.headers["www-authenticate"] == WWW_AUTHENTICATE
    assert [r.status_code for r in right] == [200, 200]
    assert httpx.get(f"{strict_gateway.url}/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{strict_gateway.url}/v1", api_key="key-three", max_retries=0).models.list()


def test_a_pinned_model_no_live_worker_serves_is_listed_and_retrieved_as_its_requests_are_taken(strict_gateway):
    """A name the `models` setting pins routes to its queue while no worker serves it (its requests
    wait there for one): the official SDK lists and retrieves it as any model it may name, where it
    was left out of the list and retrieving it was a 404. /health counts only what live workers serve."""
    sdk = openai.OpenAI(base_url=f"{strict_gateway.url}/v1", api_key=API_KEYS[0], max_retries=0)
    listed = {model.id: model for model in sdk.models.list()}
    for name in strict_gateway.models:
        card = sdk.models.retrieve(name)
        assert (card.id, card.object, card.owned_by) == (name, "model", "mili")
        assert listed[name] == card
        assert 0 < card.created <= time.time()  # the gateway's start: its queue has had no worker
    health = httpx.get(f"{strict_gateway.url}/health").json()
    assert health["model_loaded"] is True and {"tiny", "echo"} <= set(health["models"])  # the session's workers
    assert not set(strict_gateway.models) & set(health["models"])


def test_an_api_key_a_client_put_in_the_url_is_not_logged(strict_gateway):
    """A key in the path (a base URL or a model named with it); its query is never logged."""
    key = API_KEYS[1]
    for path in (f"/v1/models/{key}", f"/{key}/v1/models", f"/v1/models?api_key={key}"):
        httpx.get(f"{strict_gateway.url}{path}", headers={"Authorization": f"Bearer {key}"})
    assert eventually(lambda: "GET '/***/v1/models' -> 404" in strict_gateway.log(), timeout=10)
    assert "GET '/v1/models/***' -> 404" in strict_gateway.log()
    assert key not in strict_gateway.log()


def test_a_full_queue_is_a_429_with_retry_after(strict_gateway, redis_server):
    """max_queue_depth bounds each lane's stream of each tenant: the key's own jobs fill it."""
    with Client(redis_server.url, strict_gateway.models["full"], tenant=tenant_id(API_KEYS[0])) as client:
        waiting = [client.submit("fill", max_tokens=1) for _ in range(2)]
        try:
            response = httpx.post(
                f"{strict_gateway.url}/v1/completions",
                json={"model": "full", "prompt": "one more"},
                headers={"Authorization": f"Bearer {API_KEYS[0]}"},
            )
        finally:
            for job_id in waiting:
                client.cancel(job_id)
    assert response.status_code == 429
    assert (error_of(response)["code"], response.headers["retry-after"]) == ("queue_full", "3")
    assert response.headers["retry-after-ms"] == "3000"  # what OpenAI's SDKs read first


def test_a_request_refused_after_some_of_its_jobs_went_in_names_them_and_cancels_them(
    redis_server, redis_client, tmp_path
):
    """n=2 on a queue bound to one job (no worker serves it): the first choice's job goes in, the
    second is refused (429 queue_full) and the first is cancelled. It exists (its entry waits for a
    worker to read it), so the answer names it in x-mili-job-ids, as every answer once jobs exist:
    it went without."""
    queue = f"gw-one-{uuid.uuid4().hex[:8]}"
    gateway = GatewayProcess(
        redis_server.url, tmp_path, "--max-queue-depth", "1", "--models", json.dumps({"one": queue})
    ).start()
    try:
        response = httpx.post(
            f"{gateway.url}/v1/completions", json={"model": "one", "prompt": "two choices", "n": 2}, timeout=30
        )
        assert (response.status_code, error_of(response)["code"]) == (429, "queue_full"), response.text
        in_queue = job_ids_in_queue(redis_client, queue)
        assert len(in_queue) == 1 and response.headers.get("x-mili-job-ids") == in_queue[0], response.headers
        with Client(redis_server.url, queue) as client:
            assert eventually(lambda: client.status(in_queue[0]).status == "cancelled", timeout=10)
    finally:
        gateway.stop()


def test_the_sdks_retry_of_a_full_queue_waits_its_retry_after(strict_gateway, redis_server):
    """The SDK's retry waits the answer's retry-after-ms (3 s here), not its own backoff (0.5 s,
    then 1 s): each of its tries is a 429 logged, the last one raised."""
    sdk = openai.OpenAI(base_url=f"{strict_gateway.url}/v1", api_key=API_KEYS[0], max_retries=1)
    refused_before = strict_gateway.log().count("POST '/v1/completions' -> 429")
    with Client(redis_server.url, strict_gateway.models["full"], tenant=tenant_id(API_KEYS[0])) as client:
        waiting = [client.submit("fill", max_tokens=1) for _ in range(2)]
        try:
            started = time.monotonic()
            with pytest.raises(openai.RateLimitError) as refused:
                sdk.completions.create(model="full", prompt="one more", timeout=30)
            elapsed = time.monotonic() - started
        finally:
            for job_id in waiting:
                client.cancel(job_id)
    assert refused.value.code == "queue_full"
    assert eventually(lambda: strict_gateway.log().count("POST '/v1/completions' -> 429") == refused_before + 2)
    assert 3.0 <= elapsed < 3.0 + 5.0, elapsed


def test_a_job_past_its_deadline_is_a_504_and_is_cancelled(strict_gateway, redis_client):
    auth = {"Authorization": f"Bearer {API_KEYS[1]}"}
    response = httpx.post(
        f"{strict_gateway.url}/v1/chat/completions",
        json={"model": PARKED_MODEL, "messages": CHAT},
        headers=auth,
        timeout=30,
    )
    assert response.status_code == 504
    error = error_of(response)
    (job_id,) = job_ids_in_queue(redis_client, strict_gateway.models[PARKED_MODEL])
    # At the job's deadline, which the gateway sets to its own wait (job_timeout_s): no worker will start it.
    assert (error["code"], error["message"]) == (
        "deadline_exceeded",
        f"job {job_id} passed its deadline before a worker started it",
    )
    status = httpx.get(f"{strict_gateway.url}/v1/jobs/{job_id}", headers=auth).json()
    assert status["status"] == "cancelled"  # it never ran, and never will


def test_redis_unreachable_is_a_503(tmp_path):
    """A request retries for seconds (Redis may be failing over); /health answers at once, with the cause."""
    port = free_port()
    gw = GatewayProcess(f"redis://127.0.0.1:{port}/0", tmp_path).start()
    try:
        chat = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": CHAT}, timeout=30)
        health = httpx.get(f"{gw.url}/health", timeout=HEALTH_TIMEOUT_S)
    finally:
        gw.stop()
    assert (chat.status_code, health.status_code) == (503, 503)
    assert error_of(chat)["code"] == error_of(health)["code"] == "redis_unavailable"
    assert error_of(health)["message"] == (
        "the queue's Redis is unavailable: ConnectionError: "
        f"Error 111 connecting to 127.0.0.1:{port}. Connection refused."
    )


@pytest.mark.parametrize("kind", [RedisOutOfMemory, RedisReadOnly])
def test_writes_redis_refuses_for_now_are_a_503_as_redis_away(kind):
    """Memory full or a replica's copy: the client's typed error (a MiliError now, redis-py's raw
    error before) is answered as Redis away, 503 redis_unavailable, which the SDKs retry; not the
    500 of a MiliError the gateway knows no status for."""
    refused = kind("XADD on 'mili:q:{q}'", "refused")
    error = api_error_of(refused, retry_after_s=1)
    assert (error.status, error.body.error.type, error.body.error.code) == (
        503,
        "service_unavailable_error",
        "redis_unavailable",
    )
    assert error.body.error.message == f"the queue's Redis is unavailable: {refused.message}"


def test_refused_credentials_are_a_final_500_that_shows_no_password(redis_server, tmp_path):
    """The client's CredentialsRefused (a redis-py AuthenticationError) is the gateway's 500
    redis_refused, which asking again will not mend: Redis's reason, and neither the URL's password
    nor its user."""
    secret = "hunter2-not-shown"
    gw = GatewayProcess(redis_server.url.replace("redis://", f"redis://nobody:{secret}@"), tmp_path).start()
    try:
        chat = httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "tiny", "messages": CHAT}, timeout=30)
    finally:
        gw.stop()
    assert (chat.status_code, error_of(chat)["code"], chat.headers["x-should-retry"]) == (500, "redis_refused", "false")
    assert error_of(chat)["message"] == (
        "the queue's Redis refused the gateway's user: CredentialsRefused: invalid username-password pair or user "
        "is disabled. (fix the URL or the ACL)"
    )
    assert secret not in chat.text and "nobody" not in chat.text


@contextmanager
def gateway_of_a_silent_redis(
    tmp_path, health_timeout_s: float | None = SILENT_HEALTH_TIMEOUT_S
) -> Iterator[GatewayProcess]:
    """A gateway whose Redis is hung: a socket that takes connections and answers nothing; its log
    is still read after it stops. `health_timeout_s` None: the setting's default."""
    flags = () if health_timeout_s is None else ("--health-timeout-s", str(health_timeout_s))
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        gw = GatewayProcess(url, tmp_path, *flags).start()
        try:
            yield gw
        finally:
            gw.stop()


@pytest.mark.timing
def test_health_answers_503_within_its_timeout_while_redis_is_silent(tmp_path):
    """A hung Redis (it takes connections, answers nothing): several probes at once, each answered
    once health_timeout_s has passed, inside a probe's own timeout (httpx's here). The gateway's
    own time for each, from its request log, is the bound's."""
    with gateway_of_a_silent_redis(tmp_path) as gw:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: httpx.get(f"{gw.url}/health", timeout=HEALTH_TIMEOUT_S), range(4)))
    for response in answers:
        assert response.status_code == 503
        assert error_of(response)["message"] in (
            "the queue's Redis is unavailable: no answer within 0.3 s",
            "the queue's Redis is unavailable: TimeoutError: Timeout reading from socket",
        )
    served_ms = served_probes_ms(gw)
    assert len(served_ms) == 4, gw.log()
    assert all(
        SILENT_HEALTH_TIMEOUT_S * 1000 - LOOP_TIMER_SLACK_MS <= ms < (SILENT_HEALTH_TIMEOUT_S + 1.0) * 1000
        for ms in served_ms
    ), served_ms


@pytest.mark.timing
def test_health_answers_503_inside_kubernetes_default_probe_timeout_while_redis_is_silent(tmp_path):
    """With the default health_timeout_s, several probes at once of a gateway whose Redis takes
    connections and answers nothing each get their 503 and its cause inside Kubernetes' default
    probe timeout (1 s), where a manifest sets none: the default of 1.5 s made such a probe time
    out, a failure that says nothing of its cause."""
    default_s = GatewaySettings.model_fields["health_timeout_s"].default

    with gateway_of_a_silent_redis(tmp_path, health_timeout_s=None) as gw:
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(lambda _: httpx.get(f"{gw.url}/health", timeout=KUBERNETES_PROBE_TIMEOUT_S), range(4))
            )
    served_ms = served_probes_ms(gw)
    assert len(served_ms) == 4, gw.log()
    assert all(default_s * 1000 - LOOP_TIMER_SLACK_MS <= ms < KUBERNETES_PROBE_TIMEOUT_S * 1000 for ms in served_ms), (
        served_ms
    )
    for response in answers:
        assert response.status_code == 503
        assert error_of(response)["message"] in (
            f"the queue's Redis is unavailable: no answer within {default_s:g} s",
            "the queue's Redis is unavailable: TimeoutError: Timeout reading from socket",
        )


@pytest.mark.timing
def test_health_answers_503_at_once_to_a_limited_tenants_probes_while_redis_is_stopped(tmp_path):
    """/health behind a key of a tenant with rate limits: its 503 no longer waits on the
    x-ratelimit-* headers' read (RATE_HEADERS_TIMEOUT_S) after the probe found Redis away. Several
    probes at once, each answered well inside a probe's timeout, by the gateway's own time too."""
    key = API_KEYS[0]
    with EmbeddedRedis(port=free_port()) as server:
        with Client(server.url) as client:
            client.tenant_quotas.set(tenant_id(key), rpm=3)
        gw = GatewayProcess(server.url, tmp_path, "--api-keys", json.dumps([key]), "--monitoring-needs-key").start()

    def probe(_) -> tuple[httpx.Response, float]:
        started = time.monotonic()
        answer = httpx.get(f"{gw.url}/health", headers={"Authorization": f"Bearer {key}"}, timeout=HEALTH_TIMEOUT_S)
        return answer, time.monotonic() - started

    try:  # Redis is gone from here on
        with ThreadPoolExecutor(4) as pool:
            probes = list(pool.map(probe, range(4)))
    finally:
        gw.stop()
    for answer, elapsed in probes:
        assert (answer.status_code, error_of(answer)["code"]) == (503, "redis_unavailable")
        assert elapsed < HEALTH_TIMEOUT_S / 2, elapsed
    served_ms = served_probes_ms(gw)
    assert len(served_ms) == 4, gw.log()
    assert all(ms < RATE_HEADERS_TIMEOUT_S * 1000 / 2 for ms in served_ms), served_ms


def test_a_job_hash_no_worker_wrote_is_a_500_invalid_job_never_an_unhandled_error(gateway, redis_client):
    job_id = f"planted-{uuid.uuid4().hex[:8]}"
    redis_client.hset(Keys().job(job_id), mapping={"status": "done", "result": "not json"})
    response = httpx.get(f"{gateway.url}/v1/jobs/{job_id}")
    assert response.status_code == 500, response.text
    assert (error_of(response)["type"], error_of(response)["code"]) == ("server_error", "invalid_job")


def test_a_job_key_of_another_type_is_a_500_invalid_job_not_retried_and_other_jobs_are_served(gateway, redis_client):
    """A string where a job's hash lies (someone's SET): its status is a 500 invalid_job that tells
    OpenAI's SDKs not to retry it (`x-should-retry: false`: one request, where a 503
    redis_unavailable is retried), never a Redis failure; the gateway serves the next job."""
    job_id = f"planted-{uuid.uuid4().hex[:8]}"
    redis_client.set(Keys().job(job_id), "not a hash")
    response = httpx.get(f"{gateway.url}/v1/jobs/{job_id}")
    assert response.status_code == 500 and response.headers["x-should-retry"] == "false"
    assert error_of(response) == {
        "message": f"job {job_id!r}: a key of it holds a value of another type than its own, which no worker "
        "writes: submit it anew under a fresh id",
        "type": "server_error",
        "param": None,
        "code": "invalid_job",
    }
    retrying = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=2)
    with pytest.raises(openai.InternalServerError):
        retrying.get(f"/jobs/{job_id}", cast_to=object)
    retrying.close()
    served = httpx.post(f"{gateway.url}/v1/completions", json={"model": "echo", "prompt": "next", "max_tokens": 4})
    assert served.status_code == 200 and served.json()["choices"][0]["text"] == "next"
    served_id = served.headers["x-mili-job-ids"]
    status = httpx.get(f"{gateway.url}/v1/jobs/{served_id}")
    assert status.status_code == 200 and status.json()["status"] == "done"
    # An access line is written once its answer has gone, so the log may lag the answers (seen at
    # load): the count is read once the line of the last request, made after them all, is there.
    assert eventually(lambda: f"GET '/v1/jobs/{served_id}' -> 200" in gateway.log(), timeout=10), gateway.log()
    assert len(re.findall(rf"GET '/v1/jobs/{job_id}' -> 500", gateway.log())) == 2  # httpx's and the SDK's one


def test_a_lane_stream_of_another_type_is_a_500_not_retried_and_other_lanes_are_served(gateway, redis_client):
    """A producer made the flex lane's stream of the gateway's tenant (none: an open gateway) another
    type: its requests were a 503 redis_unavailable, which the SDKs retry; now a 500
    invalid_queue_stream with `x-should-retry: false`, and the default lane is served."""
    flex = Keys().lane_stream(ECHO_QUEUE, "flex", "-")
    # As a producer changes a key's type: deleted first. An earlier test's flex job (a batch's line,
    # tests/gateway/test_spec.py) leaves the stream there, and HSET on a stream is itself WRONGTYPE.
    redis_client.delete(flex)
    redis_client.hset(flex, "not", "a stream")
    try:
        body = {"model": "echo", "messages": CHAT, "max_tokens": 4, "service_tier": "flex"}
        response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body)
        assert response.status_code == 500 and response.headers["x-should-retry"] == "false", response.text
        assert (error_of(response)["type"], error_of(response)["code"]) == ("server_error", "invalid_queue_stream")
        served = httpx.post(f"{gateway.url}/v1/chat/completions", json={**body, "service_tier": "default"})
        assert served.status_code == 200, served.text
    finally:
        redis_client.delete(flex)


@pytest.mark.parametrize("stream", [False, True])
def test_token_ids_past_the_vocabulary_found_by_the_worker_are_a_400_naming_the_prompt(gateway, stream):
    """Only the worker knows its vocabulary: its refusal is the request's bad `prompt`, in OpenAI's
    code, before a stream starts as after a whole answer."""
    body = {"model": "tiny", "prompt": [[1, 2], [10**9]], "max_tokens": 2, "stream": stream}
    response = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = error_of(response)
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "prompt", "invalid_value")


@pytest.mark.parametrize(
    "extra, param, code, message",
    [
        (
            {"stop": ["x"] * 5},
            "stop",
            "array_above_max_length",
            "stop: List should have at most 4 items after validation, not 5",
        ),
        ({"stop": []}, "stop", "empty_array", "stop: List should have at least 1 item after validation, not 0"),
        (
            {"messages": [{"role": "user", "content": []}]},
            "messages.0.content",
            "empty_array",
            "messages.0.content: List should have at least 1 item after validation, not 0",
        ),
        ({"stop": 5}, "stop", "invalid_type", "stop: Input should be a valid string"),
    ],
)
def test_a_union_fields_error_is_its_values_member_not_the_first_member(extra, param, code, message):
    """A list of five stops is too long, not "no string": of a union's members, the error named is
    the one of the member the value's type matched, where there is one."""
    body = {"model": "tiny", "messages": CHAT, **extra}
    with pytest.raises(APIError) as refused:
        parse_body(ChatCompletionRequest, json.dumps(body))
    error = refused.value.body.error
    assert (refused.value.status, error.param, error.code, error.message) == (400, param, code, message)


@pytest.mark.parametrize(
    "extra, param, code, message",
    [
        (
            {"messages": [{"content": "hi"}]},
            "messages.0.role",
            "missing_required_parameter",
            "messages.0.role: Field required",
        ),
        ({"messages": ["hi"]}, "messages.0", "invalid_type", "messages.0: Input should be an object"),
        (
            {"messages": [{"role": "robot", "content": "hi"}]},
            "messages.0.role",
            "invalid_value",
            "messages.0.role: Input tag 'robot' is none of the expected tags: "
            "'system', 'user', 'assistant', 'tool', 'function'",
        ),
        (
            {"response_format": {}},
            "response_format.type",
            "missing_required_parameter",
            "response_format.type: Field required",
        ),
    ],
)
def test_a_tag_that_picks_no_member_is_worded_and_coded_as_any_fields_error(extra, param, code, message):
    """A message without a role, or that is no object, was an invalid_value reading "Unable to
    extract tag using discriminator <lambda>()", and a role of none of the members named
    `<lambda>()` too: pydantic's words for how it reads the tag."""
    with pytest.raises(APIError) as refused:
        parse_body(ChatCompletionRequest, json.dumps({"model": "tiny", "messages": CHAT, **extra}))
    error = refused.value.body.error
    assert (refused.value.status, error.param, error.code, error.message) == (400, param, code, message)


BATCH = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}


@pytest.mark.parametrize(
    "shape, body", [(ChatCompletionRequest, {"model": "tiny", "messages": CHAT}), (CreateBatch, BATCH)]
)
@pytest.mark.parametrize(
    "metadata, code, message",
    [
        ({"k" * 65: "v"}, "string_above_max_length", "metadata: a key is over 64 characters"),
        ({"k": "v" * 513}, "string_above_max_length", "metadata: the value of 'k' is over 512 characters"),
        (
            {f"k{i}": "v" for i in range(17)},
            "object_above_max_properties",
            "metadata: Dictionary should have at most 16 items after validation, not more",
        ),
    ],
)
def test_metadata_past_the_specs_bounds_is_a_400_naming_metadata(shape, body, metadata, code, message):
    """OpenAI's Metadata: at most 16 pairs, keys of at most 64 characters, values of at most 512.
    The count was checked alone: a 10 KiB key or a 1 MiB value went in (and a batch's is kept in Redis).
    A key or a value too long is a string too long (OpenAI's string_above_max_length)."""
    with pytest.raises(APIError) as refused:
        parse_body(shape, json.dumps({**body, "metadata": metadata}))
    error = refused.value.body.error
    assert (refused.value.status, error.param, error.code, error.message) == (400, "metadata", code, message)


@pytest.mark.parametrize(
    "shape, body", [(ChatCompletionRequest, {"model": "tiny", "messages": CHAT}), (CreateBatch, BATCH)]
)
def test_metadata_at_the_specs_bounds_is_taken(shape, body):
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    assert parse_body(shape, json.dumps({**body, "metadata": metadata})).metadata == metadata


def scrape_four_at_once(gateway: GatewayProcess) -> list[tuple[int, dict[str, float]]]:
    """Four scrapes of /metrics at once (within a probe's timeout): each one's status and samples."""

    def scrape(_) -> tuple[int, dict[str, float]]:
        answer = httpx.get(f"{gateway.url}/metrics", timeout=HEALTH_TIMEOUT_S)
        return answer.status_code, {
            f"{s.name}{sorted(s.labels.items())}": s.value
            for family in text_string_to_metric_families(answer.text)
            for s in family.samples
        }

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(scrape, range(4)))


def served_probes_ms(gateway: GatewayProcess) -> list[float]:
    """The gateway's own time for each 503 of /health, from its request log."""
    return [float(ms) for ms in re.findall(r"GET '/health' -> 503 in ([\d.]+) ms", gateway.log())]


def served_scrapes_ms(gateway: GatewayProcess) -> list[float]:
    return [float(ms) for ms in re.findall(r"GET '/metrics' -> 200 in ([\d.]+) ms", gateway.log())]


def without_backlogs(samples: dict[str, float]) -> bool:
    """Redis not read: mili_gateway_redis_up 0, and no queue series at all (not stale, not zero)."""
    return samples["mili_gateway_redis_up[]"] == 0 and not any(name.startswith("mili_queue_") for name in samples)


@pytest.mark.timing
def test_a_scrape_answers_at_once_without_the_backlogs_while_redis_is_stopped(tmp_path):
    """The backlogs' read retried for BACKLOG_TIMEOUT_S (2 s a scrape on c8ee6d1) with Redis
    stopped. A scrape asks Redis once first, as /health does: refused at once, it answers 200 with
    mili_gateway_redis_up 0 and no queue series, the gateway's own served as ever; with Redis
    there, redis_up 1 and the queue's backlog. Several scrapes at once, by the gateway's own time."""
    with EmbeddedRedis(port=free_port()) as server:
        with Client(server.url, "scraped", placement=False) as client:
            client.submit("waits", max_tokens=1)
            client.redis.zadd(Keys().queues(), {"scraped": time.time()})  # as a worker's heartbeat indexes it
        gw = GatewayProcess(server.url, tmp_path).start()
        (status, up), *_ = scrape_four_at_once(gw)
    try:  # Redis is gone from here on
        scrapes = scrape_four_at_once(gw)
    finally:
        gw.stop()
    assert (status, up["mili_gateway_redis_up[]"], up["mili_queue_waiting_jobs[('queue', 'scraped')]"]) == (200, 1, 1)
    for status, samples in scrapes:
        assert status == 200 and without_backlogs(samples), samples
        assert "mili_gateway_open_streams[]" in samples
    served_ms = served_scrapes_ms(gw)[-4:]
    assert len(served_ms) == 4, gw.log()
    assert all(ms < STRICT_TIMEOUT_S * 1000 / 2 for ms in served_ms), served_ms


@pytest.mark.timing
def test_a_scrape_answers_within_the_health_timeout_without_the_backlogs_while_redis_is_silent(tmp_path):
    """A hung Redis (it takes connections, answers nothing): each of several scrapes at once is
    answered once health_timeout_s has passed (the backlogs' 2 s bound on c8ee6d1), without the
    queue series and with redis_up 0."""
    with gateway_of_a_silent_redis(tmp_path) as gw:
        scrapes = scrape_four_at_once(gw)
    for status, samples in scrapes:
        assert status == 200 and without_backlogs(samples), samples
    served_ms = served_scrapes_ms(gw)[-4:]
    assert len(served_ms) == 4, gw.log()
    assert all(
        SILENT_HEALTH_TIMEOUT_S * 1000 - LOOP_TIMER_SLACK_MS <= ms < (SILENT_HEALTH_TIMEOUT_S + 0.7) * 1000
        for ms in served_ms
    ), served_ms


TOO_LONG_STRINGS = [
    ("/v1/completions", {"stop": ["x" * 257]}, {}, "stop"),
    ("/v1/chat/completions", {"stop": "x" * 257}, {}, "stop"),
    ("/v1/completions", {"guided_regex": "x" * 4097}, {}, "guided_regex"),
    ("/v1/chat/completions", {"safety_identifier": "x" * 65}, {}, "safety_identifier"),
    ("/v1/chat/completions", {"metadata": {"k" * 65: "v"}}, {}, "metadata"),
    ("/v1/chat/completions", {"metadata": {"k": "v" * 513}}, {}, "metadata"),
    (
        "/v1/chat/completions",
        {"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
        {},
        "tools.0.function.name",
    ),
    ("/v1/completions", {}, {"Idempotency-Key": "k" * 101}, "Idempotency-Key"),
]


@pytest.mark.parametrize("path, extra, headers, param", TOO_LONG_STRINGS)
def test_a_string_over_its_length_is_a_400_string_above_max_length_naming_it(
    gateway, redis_client, path, extra, headers, param
):
    """OpenAI answers a string longer than its field allows with `string_above_max_length` ("string
    too long"); the gateway answered most of them `invalid_value` (pydantic's string_too_long, the
    client library's stop strings, a function's name by its pattern, the Idempotency-Key) and a
    metadata key's or value's `above_max_length`, the code of a list too long. The SDK's
    BadRequestError carries the code, nothing is enqueued."""
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    before = job_ids(redis_client)
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.post(
                path.removeprefix("/v1"),
                body={"model": "echo", "max_tokens": 4, **prompt, **extra},
                cast_to=httpx.Response,
                options={"headers": headers},
            )
    finally:
        sdk.close()
    assert (refused.value.code, refused.value.param) == ("string_above_max_length", param), refused.value.body
    assert job_ids(redis_client) <= before


def test_a_very_long_id_is_echoed_cut_to_its_first_characters(gateway):
    """An error for a file, batch or model it did not find echoed the whole name the request gave:
    a 5,000-character id came back whole in its 404 (and the batch's input_file_id in its 400).
    Now its first 64 characters and an ellipsis, enough to tell which; a short id stays whole."""
    long_id = "file-" + "x" * 5000
    long_batch = "batch_" + "y" * 5000
    long_model = "m" * 5000
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    calls = {
        "retrieve file": (lambda: sdk.files.retrieve(long_id), long_id),
        "file content": (lambda: sdk.files.content(long_id), long_id),
        "delete file": (lambda: sdk.files.delete(long_id), long_id),
        "retrieve batch": (lambda: sdk.batches.retrieve(long_batch), long_batch),
        "cancel batch": (lambda: sdk.batches.cancel(long_batch), long_batch),
        "retrieve model": (lambda: sdk.models.retrieve(long_model), long_model),
        "create batch": (
            lambda: sdk.batches.create(input_file_id=long_id, endpoint="/v1/chat/completions", completion_window="24h"),
            long_id,
        ),
        "chat completion": (
            lambda: sdk.chat.completions.create(model=long_model, messages=[{"role": "user", "content": "hi"}]),
            long_model,
        ),
    }
    try:
        for name, (call, given) in calls.items():
            with pytest.raises((openai.NotFoundError, openai.BadRequestError)) as refused:
                call()
            message = refused.value.body["message"]
            assert given[:64] + "…" in message and given[:65] not in message, (name, message[:300])
            assert len(message) < 200, (name, len(message))
        with pytest.raises(openai.NotFoundError) as short:
            sdk.files.retrieve("file-" + "z" * 59)
        assert repr("file-" + "z" * 59) in short.value.body["message"]
    finally:
        sdk.close()


def test_a_long_job_id_is_echoed_cut_as_the_other_names_are(gateway):
    """docs/http-api.md: a 404's message quotes a name longer than 64 characters cut to its first 64
    and an ellipsis, a job's among them. A job id passes the client's bound (128 characters) up to
    twice that, and GET /v1/jobs/{id} quoted it whole."""
    long_job = "j" * 120
    missing = httpx.get(f"{gateway.url}/v1/jobs/{long_job}", timeout=10)
    assert missing.status_code == 404
    error = missing.json()["error"]
    assert error["code"] == "job_not_found"
    assert repr(long_job[:64] + "…") in error["message"] and long_job[:65] not in error["message"]
    short_job = "j" * 64
    assert repr(short_job) in httpx.get(f"{gateway.url}/v1/jobs/{short_job}", timeout=10).json()["error"]["message"]


PAST_A_BOUND = [
    ("/v1/chat/completions", {"temperature": 3}, "temperature", "decimal_above_max_value"),
    ("/v1/chat/completions", {"temperature": -0.5}, "temperature", "decimal_below_min_value"),
    ("/v1/completions", {"top_p": 1.5}, "top_p", "decimal_above_max_value"),
    ("/v1/chat/completions", {"presence_penalty": -2.5}, "presence_penalty", "decimal_below_min_value"),
    ("/v1/completions", {"min_p": 2}, "min_p", "decimal_above_max_value"),  # checked by the client library
    ("/v1/chat/completions", {"n": 0}, "n", "integer_below_min_value"),
    ("/v1/chat/completions", {"n": 200}, "n", "integer_above_max_value"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens", "integer_below_min_value"),  # the client library's
    ("/v1/completions", {"seed": 2**64}, "seed", "integer_above_max_value"),
    ("/v1/chat/completions", {"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length"),
    ("/v1/chat/completions", {"stop": []}, "stop", "empty_array"),
    ("/v1/chat/completions", {"messages": []}, "messages", "empty_array"),
    ("/v1/chat/completions", {"tools": [TOOL] * 129}, "tools", "array_above_max_length"),
    (
        "/v1/chat/completions",
        {"metadata": {f"k{i}": "v" for i in range(17)}},
        "metadata",
        "object_above_max_properties",
    ),
    ("/v1/chat/completions", {"temperature": "hot"}, "temperature", "invalid_type"),
    ("/v1/chat/completions", {"n": 1.5}, "n", "invalid_type"),
    ("/v1/chat/completions", {"stop": 5}, "stop", "invalid_type"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages", "invalid_type"),
]


@pytest.mark.parametrize("path, extra, param, code", PAST_A_BOUND)
def test_a_number_list_or_object_past_its_bound_or_of_another_type_is_openais_code(
    gateway, redis_client, path, extra, param, code
):
    """OpenAI answers a number past a bound by its kind and side (`integer_above_max_value`,
    `decimal_below_min_value`), a list by its length (`array_above_max_length`, `empty_array`), an
    object of too many pairs `object_above_max_properties`, a value of another JSON type
    `invalid_type`; the gateway answered codes of its own (above_max_value, below_min_length,
    above_max_length) or `invalid_value`. Each a 400 invalid_request_error naming the field, through
    the official SDK's BadRequestError, nothing enqueued."""
    prompt = {"prompt": "x"} if path == "/v1/completions" else {"messages": CHAT}
    before = job_ids(redis_client)
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.post(path.removeprefix("/v1"), body={"model": "echo", **prompt, **extra}, cast_to=httpx.Response)
    finally:
        sdk.close()
    error = refused.value.body
    assert (refused.value.status_code, error["type"], error["param"], error["code"]) == (
        400,
        "invalid_request_error",
        param,
        code,
    ), error
    assert job_ids(redis_client) <= before


@pytest.mark.parametrize("body", ["[]", "null", '"text"', "5"])
def test_a_body_that_is_no_object_stays_invalid_json_naming_no_param(body):
    """A value of another type names a field (`invalid_type`); a body that is no JSON object names
    none, and stays `invalid_json` as a body that does not parse."""
    with pytest.raises(APIError) as refused:
        parse_body(ChatCompletionRequest, body)
    error = refused.value.body.error
    assert (refused.value.status, error.type, error.param, error.code) == (
        400,
        "invalid_request_error",
        None,
        "invalid_json",
    )
