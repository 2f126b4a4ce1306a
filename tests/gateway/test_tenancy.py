"""Each API key is a tenant: its Idempotency-Keys are its own (another key reusing one gets its own
jobs; the same key with another body is refused with 422, not answered with the first result),
and so are its files and batches (another key cannot list, read, download, delete or cancel
them; an admin key can). /health and /metrics can be put behind a key. Failed key and login
attempts are rate-limited per client address, the address a trusted proxy forwards; a trusted
proxy's X-Forwarded-Proto makes the board's cookie Secure. The official SDK and plain httpx,
against gateway processes."""

from __future__ import annotations

import io
import json
import uuid

import httpx
import openai
import pytest

from tests.support.gateways import GatewayProcess
from tests.support.jobs import job_count
from tests.support.polling import eventually

KEY_A, KEY_B, ADMIN = "tenant-a-key", "tenant-b-key", "admin-key"
FAILURES_PER_MINUTE = 3


@pytest.fixture(scope="module")
def tenants_gateway(redis_server, gateway_workers, tmp_path_factory):
    process = GatewayProcess(
        redis_server.url,
        tmp_path_factory.mktemp("tenants"),
        "--api-keys",
        json.dumps([KEY_A, KEY_B]),
        "--admin-api-keys",
        json.dumps([ADMIN]),
        "--monitoring-needs-key",
        "--batch-poll-s",
        "0.1",
        "--auth-failures-per-minute",
        "1000",
        "--workers-refresh-s",
        "0.2",
    )
    yield process.start()
    process.stop()


def sdk_for(gateway: GatewayProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0)


def completion(gateway: GatewayProcess, key: str, idempotency_key: str, prompt: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/completions",
        json={"model": "echo", "prompt": prompt, "max_tokens": 16},
        headers={"Authorization": f"Bearer {key}", "Idempotency-Key": idempotency_key},
        timeout=30,
    )


def test_an_idempotency_key_is_its_api_keys_and_bound_to_its_request(tenants_gateway, redis_client):
    key = f"idem-{uuid.uuid4().hex}"
    first = completion(tenants_gateway, KEY_A, key, "tenant a")
    again = completion(tenants_gateway, KEY_A, key, "tenant a")
    assert first.status_code == again.status_code == 200
    assert first.headers["x-mili-job-ids"] == again.headers["x-mili-job-ids"]
    assert first.json()["choices"][0]["text"] == "tenant a"

    before = job_count(redis_client)
    other_body = completion(tenants_gateway, KEY_A, key, "another request")
    assert other_body.status_code == 422
    assert (other_body.json()["error"]["code"], other_body.json()["error"]["param"]) == (
        "idempotency_conflict",
        "Idempotency-Key",
    )
    assert job_count(redis_client) == before

    other_tenant = completion(tenants_gateway, KEY_B, key, "tenant b")
    assert other_tenant.status_code == 200 and other_tenant.json()["choices"][0]["text"] == "tenant b"
    assert other_tenant.headers["x-mili-job-ids"] != first.headers["x-mili-job-ids"]
    with pytest.raises(openai.UnprocessableEntityError):
        sdk_for(tenants_gateway, KEY_A).completions.create(
            model="echo",
            prompt="sdk retry, other body",
            max_tokens=4,
            extra_headers={"Idempotency-Key": key},
        )


def upload(sdk: openai.OpenAI, custom_id: str) -> str:
    line = {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "echo", "prompt": custom_id, "max_tokens": 8},
    }
    return sdk.files.create(file=("in.jsonl", io.BytesIO((json.dumps(line) + "\n").encode())), purpose="batch").id


def wait_done(sdk: openai.OpenAI, batch_id: str):
    ended = ("completed", "failed", "cancelled", "expired")
    assert eventually(lambda: sdk.batches.retrieve(batch_id).status in ended, 60, interval=0.1), sdk.batches.retrieve(
        batch_id
    )
    return sdk.batches.retrieve(batch_id)


def test_files_and_batches_are_their_api_keys_and_an_admin_keys(tenants_gateway):
    a, b, admin = (sdk_for(tenants_gateway, key) for key in (KEY_A, KEY_B, ADMIN))
    file_id = upload(a, "mine")
    batch = a.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    done = wait_done(a, batch.id)
    assert done.status == "completed"
    assert json.loads(a.files.content(done.output_file_id).text)["custom_id"] == "mine"

    for touch in (
        lambda: b.files.retrieve(file_id),
        lambda: b.files.content(file_id),
        lambda: b.files.delete(file_id),
        lambda: b.files.content(done.output_file_id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
    ):
        with pytest.raises(openai.NotFoundError):
            touch()
    with pytest.raises(openai.BadRequestError):
        b.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    assert batch.id in [x.id for x in a.batches.list(limit=100).data]
    assert batch.id not in [x.id for x in b.batches.list(limit=100).data]
    assert {file_id, done.output_file_id} <= {f.id for f in a.files.list()}
    assert not {file_id, done.output_file_id} & {f.id for f in b.files.list()}
    assert {file_id, done.output_file_id} <= {f.id for f in admin.files.list()}

    assert batch.id in [x.id for x in admin.batches.list(limit=100).data]
    assert admin.files.retrieve(file_id).id == file_id and admin.batches.retrieve(batch.id).id == batch.id
    pending = a.batches.create(
        input_file_id=upload(a, "cancel me"), endpoint="/v1/completions", completion_window="24h"
    )
    assert admin.batches.cancel(pending.id).status in ("cancelling", "cancelled", "completed")
    assert a.files.delete(file_id).deleted


def test_health_and_metrics_can_be_put_behind_a_key(tenants_gateway):
    for path in ("/health", "/metrics"):
        assert httpx.get(f"{tenants_gateway.url}{path}").status_code == 401, path
        assert (
            httpx.get(f"{tenants_gateway.url}{path}", headers={"Authorization": f"Bearer {KEY_B}"}).status_code == 200
        )


def test_health_and_metrics_stay_open_by_default(redis_server, tmp_path):
    gateway = GatewayProcess(redis_server.url, tmp_path, "--api-keys", json.dumps([KEY_A])).start()
    try:
        assert httpx.get(f"{gateway.url}/health").status_code == 200
        assert httpx.get(f"{gateway.url}/metrics").status_code == 200
        assert httpx.get(f"{gateway.url}/v1/models").status_code == 401
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def limited_gateway(redis_server, tmp_path_factory):
    """Failures limited, 127.0.0.1 trusted as a proxy (the tests play it): X-Forwarded-For names
    the client."""
    process = GatewayProcess(
        redis_server.url,
        tmp_path_factory.mktemp("limited"),
        "--api-keys",
        json.dumps([KEY_A]),
        "--auth-failures-per-minute",
        str(FAILURES_PER_MINUTE),
        "--trusted-proxies",
        json.dumps(["127.0.0.1"]),
    )
    yield process.start()
    process.stop()


def from_address(address: str, key: str) -> dict[str, str]:
    return {"X-Forwarded-For": address, "Authorization": f"Bearer {key}"}


def test_failed_key_attempts_are_limited_per_client_address(limited_gateway):
    url = f"{limited_gateway.url}/v1/models"
    for _ in range(FAILURES_PER_MINUTE):
        assert httpx.get(url, headers=from_address("203.0.113.7", "guess")).status_code == 401
    refused = httpx.get(url, headers=from_address("203.0.113.7", "guess"))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_auth_failures"
    assert 0 < int(refused.headers["retry-after"]) <= 60
    assert httpx.get(url, headers=from_address("203.0.113.7", KEY_A)).status_code == 429  # even the right key, for now
    assert httpx.get(url, headers=from_address("198.51.100.9", KEY_A)).status_code == 200  # another address


def test_failed_board_logins_count_too(limited_gateway):
    headers = {"X-Forwarded-For": "203.0.113.44"}
    for _ in range(FAILURES_PER_MINUTE):
        assert (
            httpx.post(f"{limited_gateway.url}/board/login", data={"key": "guess"}, headers=headers).status_code == 401
        )
    refused = httpx.post(f"{limited_gateway.url}/board/login", data={"key": KEY_A}, headers=headers)
    assert refused.status_code == 429


def test_a_trusted_proxys_https_makes_the_board_cookie_secure(limited_gateway, redis_server, tmp_path):
    login = httpx.post(
        f"{limited_gateway.url}/board/login",
        data={"key": KEY_A},
        headers={"X-Forwarded-Proto": "https", "X-Forwarded-For": "198.51.100.20"},
    )
    assert "Secure" in [part.strip() for part in login.headers["set-cookie"].split(";")]
    untrusted = GatewayProcess(
        redis_server.url, tmp_path, "--api-keys", json.dumps([KEY_A]), "--trusted-proxies", json.dumps(["192.0.2.1"])
    ).start()
    try:
        login = httpx.post(f"{untrusted.url}/board/login", data={"key": KEY_A}, headers={"X-Forwarded-Proto": "https"})
        assert login.status_code == 303
        assert "Secure" not in [part.strip() for part in login.headers["set-cookie"].split(";")]
        for _ in range(FAILURES_PER_MINUTE + 7):  # the default limit, 10: every forwarded address is the proxy's own
            httpx.get(f"{untrusted.url}/v1/models", headers=from_address(f"203.0.113.{_}", "guess"))
        assert httpx.get(f"{untrusted.url}/v1/models", headers=from_address("198.51.100.77", KEY_A)).status_code == 429
    finally:
        untrusted.stop()
