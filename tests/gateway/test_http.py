"""The seed's endpoints (POST /generate, GET /health), a job's status, Prometheus metrics and
the gateway's Idempotency-Key, over plain httpx."""

import asyncio
import http.client
import io
import json
import logging
import socket
import time
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.api_keys import tenant_id
from gateway.metrics import QueueBacklogs, read_backlogs
from harness.polling import eventually
from producer_client import AsyncClient, Client
from producer_client.keys import PROTOCOL_VERSION, Keys
from producer_client.tenant_labels import MAX_TENANT_LABELS, OTHER_TENANTS
from tests.gateway.support import ECHO_QUEUE, PARKED_QUEUE
from tests.support.gateways import GatewayProcess
from tests.support.jobs import job_ids, job_ids_in_queue
from worker.embedded_redis import EmbeddedRedis, free_port


def test_generate_returns_the_text_and_usage_of_its_job(gateway, redis_server):
    response = httpx.post(f"{gateway.url}/generate", json={"model": "echo", "prompt": "echo me", "max_tokens": 4})
    body = response.json()
    job_id = response.headers["x-mili-job-ids"]
    with Client(redis_server.url, ECHO_QUEUE) as client:
        result = client.result(job_id, timeout=10)
    assert response.status_code == 200
    assert body["generated_text"] == result.text == "echo"
    assert body["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == 7 and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == 11


def test_generate_without_a_model_goes_to_the_default_queue_and_a_client_that_leaves_cancels_it(
    gateway, redis_server, redis_client
):
    # No worker serves the default queue here: the job waits until its client gives up.
    before = set(job_ids_in_queue(redis_client, "default"))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/generate", json={"prompt": "for the default queue"}, timeout=1)
    (job_id,) = set(job_ids_in_queue(redis_client, "default")) - before
    with Client(redis_server.url) as client:
        assert eventually(lambda: client.status(job_id).status == "cancelled", timeout=5)


def test_health_says_a_model_is_loaded_and_which(gateway):
    body = httpx.get(f"{gateway.url}/health").json()
    assert body["status"] == "ok" and body["model_loaded"] is True
    assert {"tiny", "echo"} <= set(body["models"])


def test_job_status_of_a_finished_job(gateway):
    response = httpx.post(f"{gateway.url}/v1/completions", json={"model": "echo", "prompt": "abc", "max_tokens": 8})
    job_id = response.headers["x-mili-job-ids"]
    status = httpx.get(f"{gateway.url}/v1/jobs/{job_id}").json()
    assert (status["id"], status["status"], status["tokens"]) == (job_id, "done", 3)
    assert status["result"]["text"] == "abc"


def test_an_idempotency_key_maps_a_repeated_request_to_the_same_jobs(gateway, redis_client):
    key = uuid.uuid4().hex
    body = {"model": "echo", "prompt": "once", "max_tokens": 8, "n": 2}
    first, again = (
        httpx.post(f"{gateway.url}/v1/completions", json=body, headers={"Idempotency-Key": key}) for _ in range(2)
    )
    assert first.headers["x-mili-job-ids"] == again.headers["x-mili-job-ids"] == f"{key}-0,{key}-1"
    assert first.json()["id"] == again.json()["id"] == f"cmpl-{key}"
    assert first.json()["choices"] == again.json()["choices"]
    assert first.headers["x-request-id"] != again.headers["x-request-id"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_open_gateway_refuses_an_idempotency_key_whose_jobs_ids_would_read_as_a_tenants(
    gateway, sdk, redis_client, stream
):
    """An open gateway's jobs are no tenant's, and a job's tenant is its id's up to the first dot:
    `team-a.x` made jobs `team-a.x-0`, which team-a's pinned Redis user may read and cancel, and a
    keyed gateway shows the key whose tenant id it names. Such a key is a 400 naming the header
    before anything is enqueued, through the official SDK, streamed or not, and on /generate."""
    before = job_ids(redis_client)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "whose"}],
            max_tokens=4,
            stream=stream,
            extra_headers={"Idempotency-Key": f"team-a.{uuid.uuid4().hex}"},
        )
    generate = httpx.post(
        f"{gateway.url}/generate",
        json={"model": "echo", "prompt": "whose", "max_tokens": 4},
        headers={"Idempotency-Key": f"{tenant_id('some-key')}.{uuid.uuid4().hex}"},
    )
    assert (refused.value.status_code, refused.value.body["param"], refused.value.body["type"]) == (
        400,
        "Idempotency-Key",
        "invalid_request_error",
    )
    assert "no '.'" in refused.value.body["message"]
    assert (generate.status_code, generate.json()["error"]["param"]) == (400, "Idempotency-Key")
    assert job_ids(redis_client) <= before


def test_the_official_sdks_own_idempotency_keys_map_its_retries_to_the_same_jobs(gateway):
    """The keys the SDK makes itself (`stainless-python-retry-<uuid>`, one per call, sent again on
    each of its retries where the client names the header: OpenAI's leaves it unnamed) hold no dot:
    an open gateway takes them, and the call's jobs are `<key>-0`."""
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    client._idempotency_header = "Idempotency-Key"  # as the Stainless SDKs of APIs that take one do
    try:
        raw = client.completions.with_raw_response.create(model="echo", prompt="sdk key", max_tokens=4)
    finally:
        client.close()
    key = raw.http_request.headers["idempotency-key"]
    assert key.startswith("stainless-python-retry-")
    assert (raw.status_code, raw.headers["x-mili-job-ids"]) == (200, f"{key}-0")
    assert raw.parse().choices[0].text == "sdk "


def test_metrics_count_requests_by_route_and_status_and_time_the_first_byte(gateway):
    httpx.post(f"{gateway.url}/v1/completions", json={"model": "echo", "prompt": "m", "max_tokens": 1})
    httpx.post(f"{gateway.url}/v1/completions", json={"model": "echo", "prompt": "m", "max_tokens": 1, "stream": True})
    httpx.post(f"{gateway.url}/v1/completions", json={"model": "no-such-model", "prompt": "m"})
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text)
        for s in family.samples
    }
    route = ("endpoint", "/v1/completions")
    assert samples[("mili_gateway_requests_total", (route, ("status", "200")))] >= 2
    assert samples[("mili_gateway_requests_total", (route, ("status", "404")))] >= 1
    assert samples[("mili_gateway_time_to_first_byte_seconds_count", (route,))] >= 3
    assert samples[("mili_gateway_open_streams", ())] == 0


def test_metrics_count_every_queues_backlog_over_its_lanes_and_its_workers_streams(gateway, redis_server, redis_client):
    """A queue no worker serves now (in the queue index from an earlier heartbeat): its jobs wait in
    its own stream, a tenant's flex stream and a worker's own stream, and every one counts in the
    gauges KEDA scales on."""
    keys, queue = Keys(), f"backlog-{uuid.uuid4().hex[:8]}"
    redis_client.zadd(keys.queues(), {queue: time.time()})
    with Client(redis_server.url, queue, placement=False) as client:
        client.submit("plain", max_tokens=1)
        client.as_tenant("ta").submit_many([{"prompt": "flex", "service_tier": "flex"}] * 2)
    redis_client.zadd(keys.workers(queue), {"w1": time.time()})
    redis_client.xadd(
        keys.own_queue(queue, "w1"), {"id": "placed-1", "v": str(PROTOCOL_VERSION), "body": "{}", "cost": "9"}
    )
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text)
        for s in family.samples
        if s.labels.get("queue") == queue
    }
    assert samples == {
        ("mili_queue_depth_jobs", (("queue", queue),)): 4,
        ("mili_queue_pending_jobs", (("queue", queue),)): 0,
        ("mili_queue_waiting_jobs", (("queue", queue),)): 4,
        ("mili_queue_lane_waiting_jobs", (("lane", "priority"), ("queue", queue), ("tenant", ""))): 0,
        ("mili_queue_lane_waiting_jobs", (("lane", "default"), ("queue", queue), ("tenant", ""))): 1,
        ("mili_queue_lane_waiting_jobs", (("lane", "flex"), ("queue", queue), ("tenant", ""))): 0,
        ("mili_queue_lane_waiting_jobs", (("lane", "flex"), ("queue", queue), ("tenant", "ta"))): 2,
        ("mili_queue_lane_waiting_jobs", (("lane", "placed"), ("queue", queue), ("tenant", ""))): 1,
    }


def test_metrics_export_a_bounded_number_of_tenant_series_of_waiting_jobs_and_count_the_rest_as_other(
    redis_server, caplog
):
    """Tenants are names producers choose: one series each of the lanes' backlogs let a producer
    naming thousands grow the gateway's /metrics (and Prometheus's memory) without end, as a
    worker's mili_served_tokens did. Past MAX_TENANT_LABELS tenants, the rest count under
    OTHER_TENANTS, every job still counted, the same tenants named at the next scrape, said in one
    log line."""
    queue = f"tenants-{uuid.uuid4().hex[:8]}"
    names = [f"t{i:03d}-{uuid.uuid4().hex[:6]}" for i in range(MAX_TENANT_LABELS + 7)]
    with Client(redis_server.url, queue, placement=False) as client:
        for name in names:
            client.as_tenant(name).submit("flex", max_tokens=1, service_tier="flex")
        backlogs = QueueBacklogs()
        backlogs.stats = [client.queue_stats()]

    def flex_by_tenant() -> dict[str, float]:
        (lanes,) = [f for f in backlogs.collect() if f.name == "mili_queue_lane_waiting_jobs"]
        return {s.labels["tenant"]: s.value for s in lanes.samples if s.labels["lane"] == "flex"}

    with caplog.at_level(logging.WARNING, logger="gateway"):
        scraped = flex_by_tenant()
        assert flex_by_tenant() == scraped
    assert set(scraped) - {"", OTHER_TENANTS} <= set(names)
    assert len(scraped) == MAX_TENANT_LABELS + 2 and scraped[OTHER_TENANTS] == 7 and scraped[""] == 0
    assert sum(scraped.values()) == len(names)
    assert len([r for r in caplog.records if OTHER_TENANTS in r.getMessage()]) == 1


def test_metrics_count_the_backlog_of_the_queues_it_routes_to_that_no_worker_ever_served(tmp_path):
    """KEDA scales the workers from zero on the default queue's backlog (docker/k8s/scaledobject.yaml:
    minReplicaCount 0 "works too"), but with no worker up none heartbeats the queue into the queue
    index (a fresh Redis), or it left the index an hour after the last one while another queue's
    workers ran: the gauge KEDA asks for was absent, an error to its trigger, and no worker ever
    started. The queues the gateway routes to whatever the workers say (default_queue, the models'
    pins) count always, as on the board."""
    with EmbeddedRedis(port=free_port()) as server:
        gateway = GatewayProcess(
            server.url, tmp_path, "--default-queue", "cold", "--models", json.dumps({"pinned-model": "pinned"})
        )
        try:
            gateway.start()
            with Client(server.url, "cold") as client:
                client.submit("waits for a worker", max_tokens=1)
            waiting = {
                s.labels["queue"]: s.value
                for family in text_string_to_metric_families(httpx.get(f"{gateway.url}/metrics").text)
                for s in family.samples
                if s.name == "mili_queue_waiting_jobs"
            }
        finally:
            gateway.stop()
    assert waiting == {"cold": 1, "pinned": 0}


# The headers a HEAD and its GET may differ in: each answer's own, the framing of a body a HEAD does
# not send (RFC 9110 9.3.2 lets it go), and a length where the body changes between two reads (the
# metrics' counts, the board's job lists).
OWN_HEADERS = {"date", "x-request-id", "transfer-encoding"}
CHANGING_BODIES = {"/metrics", "/board", "/board/overview"}


def test_every_get_route_answers_head_as_its_get_without_a_body(gateway, redis_server, sdk):
    """RFC 9110 9.3.2: HEAD is GET without the body; probes and uptime checkers send it. Every GET
    route of the gateway (found or not: a 404 is the GET's too), a Host the open gateway refuses
    (400 as GET), and a board job's event stream, whose HEAD ends at its head: the same connection
    then serves the next request (the stream would have held it until the job's end)."""
    with Client(redis_server.url, PARKED_QUEUE) as client:
        parked = client.submit("never served", max_tokens=1)  # its events would never end
    file_id = sdk.files.create(file=("in.jsonl", io.BytesIO(b'{"custom_id": "a"}\n')), purpose="batch").id
    paths = [
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/models/echo",
        "/v1/models/no-such-model",
        f"/v1/jobs/{parked}",
        "/v1/jobs/no-such-job",
        "/v1/files",
        f"/v1/files/{file_id}",
        f"/v1/files/{file_id}/content",
        "/v1/files/file-none",
        "/v1/batches",
        "/v1/batches/batch_none",
        "/board",
        "/board/overview",
        f"/board/job?id={parked}",
        f"/board/job/summary?id={parked}",
        "/board/login",
        "/no/such/route",
    ]
    for path, host in [*((p, None) for p in paths), ("/metrics", "evil.example")]:
        headers = {} if host is None else {"Host": host}
        get, head = (httpx.request(m, f"{gateway.url}{path}", headers=headers) for m in ("GET", "HEAD"))
        assert (head.status_code, head.content) == (get.status_code, b""), path
        ignored = OWN_HEADERS | ({"content-length"} if path in CHANGING_BODIES else set())
        assert {k: v for k, v in head.headers.items() if k not in ignored} == {
            k: v for k, v in get.headers.items() if k not in ignored
        }, path
    with httpx.Client(base_url=gateway.url, timeout=5, limits=httpx.Limits(max_connections=1)) as one_connection:
        events = one_connection.head("/board/job/events", params={"id": parked})
        assert (events.status_code, events.headers["content-type"], events.content) == (
            200,
            "text/event-stream; charset=utf-8",
            b"",
        )
        assert one_connection.get("/health").status_code == 200


def test_a_workers_metrics_answer_head_as_get_without_a_body(gateway_workers):
    """The worker's endpoint (prometheus_client's app under wsgiref) answered HEAD 405, with a body
    a HEAD must not have; now its GET's head, Content-Length included, and a Host it refuses 400
    as for GET. Raw requests: a client that reads a HEAD's answer knows to read no body after it."""
    port = int(gateway_workers[1].heartbeat()["metrics_port"])
    for host, status in ((f"127.0.0.1:{port}", 200), ("evil.example", 400)):
        get, head = (raw_answer(port, method, host) for method in ("GET", "HEAD"))
        assert (get.status, head.status, head.read()) == (status, status, b"")
        # The length the GET's body has: a gauge of the worker's may change it between two reads.
        assert eventually(lambda host=host: head_length_is_the_gets(port, host), timeout=10, interval=0.2)


def test_a_workers_metrics_name_head_in_allow_wherever_get_is(gateway_workers):
    """prometheus_client's app answered a POST/PUT/DELETE 405 (and OPTIONS 200) with `Allow:
    OPTIONS,GET`, leaving out the HEAD the endpoint answers (head_as_get); the gateway's 405s list
    HEAD beside GET (gateway/head.py), as RFC 9110 15.5.6 asks of Allow."""
    port = int(gateway_workers[1].heartbeat()["metrics_port"])
    for method, status in (("POST", 405), ("PUT", 405), ("DELETE", 405), ("OPTIONS", 200)):
        answer = raw_answer(port, method, f"127.0.0.1:{port}")
        allowed = [m.strip() for m in answer.getheader("allow").split(",")]
        assert (answer.status, sorted(allowed)) == (status, ["GET", "HEAD", "OPTIONS"]), method


def head_length_is_the_gets(port: int, host: str) -> bool:
    get, head = (raw_answer(port, method, host) for method in ("GET", "HEAD"))
    return int(head.getheader("content-length")) == len(get.read()) > 0


def raw_answer(port: int, method: str, host: str) -> http.client.HTTPResponse:
    """The answer to `method /metrics` with `host` as its Host header (no Accept-Encoding: the
    body's length is the same at each read of an idle worker's counters)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.putrequest(method, "/metrics", skip_host=True, skip_accept_encoding=True)
    connection.putheader("Host", host)
    connection.endheaders()
    return connection.getresponse()


def test_a_scrape_waits_for_the_backlogs_no_longer_than_its_bound_when_redis_does_not_answer():
    """A server that accepts connections and never answers (a hung Redis): the queue gauges are
    left out after the bound, and the rest of the scrape goes on."""

    async def scrape(port: int) -> list | None:
        client = AsyncClient(f"redis://127.0.0.1:{port}/0", "q")
        try:
            return await read_backlogs(client, timeout_s=0.3)
        finally:
            await client.aclose()

    with socket.create_server(("127.0.0.1", 0)) as silent:
        started = time.monotonic()
        assert asyncio.run(scrape(silent.getsockname()[1])) is None
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_after_the_jobs_were_enqueued_names_them_in_x_mili_job_ids(gateway, stream):
    """Every response names its jobs once they exist (docs/http-api.md): an error found by the
    worker (a prompt longer than the echo worker's 4,096-token context) was answered without them,
    so its job could not be looked up."""
    body = {"model": "echo", "messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 4, "stream": stream}
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    (job_id,) = response.headers["x-mili-job-ids"].split(",")
    status = httpx.get(f"{gateway.url}/v1/jobs/{job_id}").json()
    assert (status["status"], status["result"]["error"]["code"]) == ("failed", "prompt_too_long"), status
