"""Each API key is a tenant: its Idempotency-Keys are its own (another key reusing one gets its own
jobs; the same key with another body is refused with 422, not answered with the first result),
and so are its jobs, files and batches (another key cannot list, read, download, delete or cancel
them, and is answered as for an id that does not exist; an admin key can). /health and /metrics can be put behind a key. A client address (the one
a trusted proxy forwards) past its limit of wrong keys or logins gets its further wrong ones
answered 429, at no Redis command, while every right key from that address is served; the
gateway warns at start of each key that could be guessed. A trusted proxy's X-Forwarded-Proto
makes the board's cookie Secure. The official SDK and plain httpx, against gateway processes."""

from __future__ import annotations

import io
import json
import math
import secrets
import uuid

import httpx
import openai
import pytest
import redis

from gateway.api_keys import Tenant, tenant_id
from gateway.errors import WWW_AUTHENTICATE
from harness.polling import eventually
from producer_client import Client, InvalidArgument
from producer_client.new_job import fresh_job_id
from tests.openai_spec import check
from tests.support.gateways import GatewayProcess
from tests.support.jobs import job_ids
from worker.embedded_redis import EmbeddedRedis, free_port

KEY_A, KEY_B, ADMIN = "tenant-a-key", "tenant-b-key", "admin-key"
STRONG_KEY, STRONG_ADMIN = secrets.token_urlsafe(32), secrets.token_urlsafe(32)  # as docs/security.md asks
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

    before = job_ids(redis_client)
    other_body = completion(tenants_gateway, KEY_A, key, "another request")
    assert other_body.status_code == 422
    assert (other_body.json()["error"]["code"], other_body.json()["error"]["param"]) == (
        "idempotency_conflict",
        "Idempotency-Key",
    )
    assert job_ids(redis_client) <= before

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


def test_a_keyed_gateway_takes_an_idempotency_key_with_a_dot_under_its_tenant(tenants_gateway):
    """With API keys the key is scoped, `<tenant>.K-0`: the id's tenant is the API key's whatever
    dots K holds (an open gateway refuses them: test_http)."""
    key = f"team-a.{uuid.uuid4().hex}"
    answer = completion(tenants_gateway, KEY_A, key, "dotted")
    assert (answer.status_code, answer.headers["x-mili-job-ids"]) == (200, f"{tenant_id(KEY_A)}.{key}-0")
    assert Tenant(tenant_id(KEY_A)).owns_job(answer.headers["x-mili-job-ids"])


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
    answered = json.loads(a.files.content(done.output_file_id).text)
    assert answered["custom_id"] == "mine"
    # Its line's job is the key's, as a request's (its id begins with the key's tenant): found by
    # its key, not by another's.
    line_job = answered["response"]["request_id"] + "-0"
    assert line_job.startswith(f"{tenant_id(KEY_A)}.")
    assert (
        get(tenants_gateway, f"/v1/jobs/{line_job}", KEY_A).status_code,
        get(tenants_gateway, f"/v1/jobs/{line_job}", KEY_B).status_code,
    ) == (200, 404)

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


def get(gateway: GatewayProcess, path: str, key: str | None) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{gateway.url}{path}", headers=headers, timeout=30)


def body_without(response: httpx.Response, object_id: str) -> dict:
    """The answer's body with `object_id` (which its message names) put as ID."""
    return json.loads(response.text.replace(object_id, "ID"))


def test_a_job_is_its_api_keys_and_an_admin_keys_and_another_key_finds_no_such_job(tenants_gateway):
    """Key A's jobs (a fresh id's and an Idempotency-Key's) are 404 to key B, in the body of an id
    that was never submitted, whether made up or of B's own form; 200 to A and to an admin key."""
    plain = completion(tenants_gateway, KEY_A, f"idem-{uuid.uuid4().hex}", "job of a")
    fresh = httpx.post(
        f"{tenants_gateway.url}/v1/completions",
        json={"model": "echo", "prompt": "fresh job of a", "max_tokens": 4},
        headers={"Authorization": f"Bearer {KEY_A}"},
        timeout=30,
    )
    assert plain.status_code == fresh.status_code == 200
    job_ids = [plain.headers["x-mili-job-ids"], fresh.headers["x-mili-job-ids"]]
    assert all(job_id.startswith(f"{tenant_id(KEY_A)}.") for job_id in job_ids)
    made_up = get(tenants_gateway, f"/v1/jobs/{uuid.uuid4().hex}", KEY_B)
    own_form = get(tenants_gateway, f"/v1/jobs/{tenant_id(KEY_B)}.{uuid.uuid4().hex}", KEY_B)
    assert made_up.status_code == own_form.status_code == 404
    check("ErrorResponse", made_up.json())
    missing = body_without(made_up, made_up.url.path.rsplit("/", 1)[1])
    assert missing == body_without(own_form, own_form.url.path.rsplit("/", 1)[1])
    assert missing["error"]["code"] == "job_not_found"
    for job_id in job_ids:
        of_b = get(tenants_gateway, f"/v1/jobs/{job_id}", KEY_B)
        assert of_b.status_code == 404 and body_without(of_b, job_id) == missing
        for key in (KEY_A, ADMIN):
            status = get(tenants_gateway, f"/v1/jobs/{job_id}", key)
            assert status.status_code == 200 and status.json()["status"] == "done", key
        assert get(tenants_gateway, f"/v1/jobs/{job_id}", None).status_code == 401


def test_another_keys_file_or_batch_is_answered_as_one_that_does_not_exist(tenants_gateway):
    """Every route that names a file or batch by id answers key B, for key A's, exactly as for an
    id never created (status and body), while A and an admin key are served."""
    file_id = upload(sdk_for(tenants_gateway, KEY_A), "yours")
    batch_id = (
        sdk_for(tenants_gateway, KEY_A)
        .batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
        .id
    )
    made_up = {file_id: f"file-{uuid.uuid4().hex}", batch_id: f"batch_{uuid.uuid4().hex}"}
    routes = [
        ("GET", "/v1/files/{}", file_id),
        ("GET", "/v1/files/{}/content", file_id),
        ("POST", "/v1/batches/{}/cancel", batch_id),
        ("GET", "/v1/batches/{}", batch_id),
        ("DELETE", "/v1/files/{}", file_id),
    ]
    for method, route, object_id in routes:
        of_a = ask(tenants_gateway, method, route.format(object_id), KEY_B)
        never = ask(tenants_gateway, method, route.format(made_up[object_id]), KEY_B)
        assert of_a.status_code == never.status_code == 404, route
        assert body_without(of_a, object_id) == body_without(never, made_up[object_id]), route
        if method == "GET":
            for key in (KEY_A, ADMIN):
                assert ask(tenants_gateway, method, route.format(object_id), key).status_code == 200, (route, key)
    after_a = get(tenants_gateway, f"/v1/files?after={file_id}", KEY_B)
    assert after_a.status_code == 200 and after_a.json() == get(tenants_gateway, "/v1/files", KEY_B).json()
    assert get(tenants_gateway, f"/v1/files/{file_id}", KEY_A).status_code == 200  # B's DELETE deleted nothing


def ask(gateway: GatewayProcess, method: str, path: str, key: str) -> httpx.Response:
    return httpx.request(method, f"{gateway.url}{path}", headers={"Authorization": f"Bearer {key}"}, timeout=30)


def test_with_admin_keys_the_board_lets_in_only_them(tenants_gateway):
    """The board shows and acts on every tenant's jobs: where admin keys are set, a tenant's key is
    refused there (login form, Bearer pages, reads and actions) with a 403 that says the board needs
    an admin key, in the gateway's error shape (RFC 9110: the key is right, its rights are not
    enough; it was the 401 of a wrong key); a wrong or
    missing key stays a 401; an admin key is let in."""
    job_id = completion(tenants_gateway, KEY_A, f"idem-{uuid.uuid4().hex}", "on the board").headers["x-mili-job-ids"]
    board = f"{tenants_gateway.url}/board"

    def attempts(key: str | None) -> list[httpx.Response]:
        bearer = {"X-MILI-Board": "1"} | ({} if key is None else {"Authorization": f"Bearer {key}"})
        return [
            httpx.get(board, headers=bearer),
            httpx.get(f"{board}/job", params={"id": job_id}, headers=bearer),
            httpx.get(f"{board}/overview", headers=bearer),
            httpx.get(f"{board}/job/summary", params={"id": job_id}, headers=bearer),
            httpx.post(f"{board}/job/cancel", params={"id": job_id}, headers=bearer),
        ]

    for key in (KEY_A, KEY_B):
        form = httpx.post(f"{board}/login", data={"key": key})
        assert (form.status_code, "needs an admin key" in form.text) == (403, True), key
        refused = attempts(key)
        assert [r.status_code for r in refused] == [403] * 5, key
        for answer in refused:
            assert "www-authenticate" not in answer.headers, key
            assert answer.json() == {
                "error": {
                    "message": answer.json()["error"]["message"],
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "admin_key_required",
                }
            }, key
            assert "admin key" in answer.json()["error"]["message"], key
    wrong_form = httpx.post(f"{board}/login", data={"key": "not-a-key"})
    assert wrong_form.status_code == 401 and wrong_form.headers["www-authenticate"] == WWW_AUTHENTICATE
    for key in ("not-a-key", None):
        pages, *reads = attempts(key)[:1] + attempts(key)[2:]
        assert (pages.status_code, pages.headers["location"]) == (303, "/board/login"), key
        assert [r.status_code for r in reads] == [401] * 3, key
        assert all(r.json()["error"]["code"] == "invalid_api_key" for r in reads), key
        assert all(r.headers["www-authenticate"] == WWW_AUTHENTICATE for r in reads), key  # RFC 9110 11.6.1
    let_in = httpx.post(f"{board}/login", data={"key": ADMIN})
    assert let_in.status_code == 303 and let_in.headers["location"] == "/board"
    admin = {"Authorization": f"Bearer {ADMIN}"}
    assert httpx.get(f"{board}/job/summary", params={"id": job_id}, headers=admin).status_code == 200


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_health_and_metrics_can_be_put_behind_a_key(tenants_gateway, method):
    """HEAD as GET: refused without the key, answered with it (a HEAD's 401 and 200 bodiless)."""
    for path in ("/health", "/metrics"):
        refused = httpx.request(method, f"{tenants_gateway.url}{path}")
        assert (refused.status_code, refused.headers.get("www-authenticate")) == (401, WWW_AUTHENTICATE), path
        let_in = httpx.request(method, f"{tenants_gateway.url}{path}", headers={"Authorization": f"Bearer {KEY_B}"})
        assert let_in.status_code == 200
        assert (let_in.content == b"") is (method == "HEAD")


def test_a_head_of_another_keys_job_is_a_404_as_its_get(tenants_gateway):
    """HEAD goes through the same tenancy as GET: another key's job is missing to it, its own found."""
    job_id = completion(tenants_gateway, KEY_A, f"head-{uuid.uuid4().hex}", "whose").headers["x-mili-job-ids"]
    url = f"{tenants_gateway.url}/v1/jobs/{job_id}"
    for key, status in ((KEY_B, 404), (KEY_A, 200)):
        auth = {"Authorization": f"Bearer {key}"}
        head, get = httpx.head(url, headers=auth), httpx.get(url, headers=auth)
        assert (head.status_code, get.status_code, head.content) == (status, status, b"")
        assert head.headers["content-length"] == get.headers["content-length"]


def test_health_and_metrics_stay_open_by_default(redis_server, tmp_path):
    gateway = GatewayProcess(redis_server.url, tmp_path, "--api-keys", json.dumps([KEY_A])).start()
    try:
        assert httpx.get(f"{gateway.url}/health").status_code == 200
        assert httpx.get(f"{gateway.url}/metrics").status_code == 200
        assert httpx.get(f"{gateway.url}/v1/models").status_code == 401
    finally:
        gateway.stop()


@pytest.fixture(scope="module")
def quiet_redis():
    """A redis-server of the limited gateway's alone: every command it counts is that gateway's."""
    with EmbeddedRedis(port=free_port()) as server:
        yield server


@pytest.fixture(scope="module")
def limited_gateway(quiet_redis, tmp_path_factory):
    """Failures limited, 127.0.0.1 trusted as a proxy (the tests play it): X-Forwarded-For names
    the client. Its batch driver looks for batches once, at start: then the gateway sends Redis
    nothing but what its requests need."""
    process = GatewayProcess(
        quiet_redis.url,
        tmp_path_factory.mktemp("limited"),
        "--api-keys",
        json.dumps([KEY_A, STRONG_KEY]),
        "--admin-api-keys",
        json.dumps([STRONG_ADMIN]),
        "--auth-failures-per-minute",
        str(FAILURES_PER_MINUTE),
        "--trusted-proxies",
        json.dumps(["127.0.0.1"]),
        "--batch-poll-s",
        "3600",
    )
    yield process.start()
    process.stop()


def from_address(address: str, key: str) -> dict[str, str]:
    return {"X-Forwarded-For": address, "Authorization": f"Bearer {key}"}


def commands_served(client: redis.Redis) -> dict[str, int]:
    """Calls per command since the server started, but INFO's (this function's own: `client`
    keeps its one connection, whose handshake counted once, before the first call returned)."""
    return {name: stat["calls"] for name, stat in client.info("commandstats").items() if name != "cmdstat_info"}


def test_one_clients_wrong_keys_leave_every_other_client_at_its_address_served(limited_gateway, quiet_redis):
    """Behind a NAT every client has one address, as the proxy forwards it: a guesser's wrong keys
    there get 401 up to the limit, then 429 with Retry-After, at no Redis command; every key
    holder at that address is served all along, the guesser's own right key too."""
    url = f"{limited_gateway.url}/v1/models"
    shared = "203.0.113.7"
    assert httpx.get(url, headers=from_address(shared, KEY_A)).status_code == 200  # the registry read once
    counter = redis.Redis.from_url(quiet_redis.url, decode_responses=True)
    before = commands_served(counter)
    unauthorized = [httpx.get(url, headers=from_address(shared, f"guess-{i}")) for i in range(FAILURES_PER_MINUTE)]
    refused = [httpx.get(url, headers=from_address(shared, f"guess-{i}")) for i in range(3 * FAILURES_PER_MINUTE)]
    assert commands_served(counter) == before
    counter.close()
    assert [r.status_code for r in unauthorized] == [401] * FAILURES_PER_MINUTE
    assert [r.status_code for r in refused] == [429] * 3 * FAILURES_PER_MINUTE
    for answer in refused:
        check("ErrorResponse", answer.json())
        assert (answer.json()["error"]["code"], answer.json()["error"]["type"]) == (
            "too_many_auth_failures",
            "rate_limit_error",
        )
        assert 0 < int(answer.headers["retry-after-ms"]) <= 60_000
        assert int(answer.headers["retry-after"]) == math.ceil(int(answer.headers["retry-after-ms"]) / 1000)
    for key in (KEY_A, STRONG_KEY, STRONG_ADMIN):
        assert httpx.get(url, headers=from_address(shared, key)).status_code == 200, key
    sdk = openai.OpenAI(
        base_url=f"{limited_gateway.url}/v1",
        api_key=STRONG_KEY,
        max_retries=0,
        default_headers={"X-Forwarded-For": shared},
    )
    assert sdk.models.list().data == []  # no worker on this Redis: served, with nothing to list
    assert httpx.get(url, headers=from_address(shared, "guess")).status_code == 429  # the guesser still is not
    assert httpx.get(url, headers=from_address("198.51.100.9", "guess")).status_code == 401  # another address


def test_a_right_board_login_is_let_in_whatever_its_address_failed(limited_gateway):
    headers = {"X-Forwarded-For": "203.0.113.44"}
    login = f"{limited_gateway.url}/board/login"
    for _ in range(FAILURES_PER_MINUTE):
        assert httpx.post(login, data={"key": "guess"}, headers=headers).status_code == 401
    refused = httpx.post(login, data={"key": "guess"}, headers=headers)
    assert refused.status_code == 429 and 0 < int(refused.headers["retry-after-ms"]) <= 60_000
    # As every 429's: the time left to the millisecond, and in whole seconds rounded up.
    assert int(refused.headers["retry-after"]) == math.ceil(int(refused.headers["retry-after-ms"]) / 1000)
    let_in = httpx.post(login, data={"key": STRONG_ADMIN}, headers=headers)
    assert let_in.status_code == 303 and let_in.headers["location"] == "/board"


def test_the_gateway_warns_at_start_of_each_weak_key_naming_its_place_only(limited_gateway):
    log = limited_gateway.log_of_this_start()
    warnings = [line for line in log.splitlines() if "can be guessed" in line]
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "api_keys[0] can be guessed" in warnings[0]
    assert KEY_A not in log and tenant_id(KEY_A) not in log


def test_a_trusted_proxys_https_makes_the_board_cookie_secure(limited_gateway, redis_server, tmp_path):
    login = httpx.post(
        f"{limited_gateway.url}/board/login",
        data={"key": STRONG_ADMIN},
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
        assert (
            httpx.get(f"{untrusted.url}/v1/models", headers=from_address("198.51.100.77", "guess")).status_code == 429
        )
        assert httpx.get(f"{untrusted.url}/v1/models", headers=from_address("198.51.100.77", KEY_A)).status_code == 200
    finally:
        untrusted.stop()


@pytest.mark.parametrize("posing", ["{key}.x", "{key}.", "{key}.{other}"])
def test_no_library_tenant_makes_ids_an_api_keys_tenant_takes_for_its_own(redis_server, posing):
    # Job ids are `<tenant>.<32 hex>`: a library tenant named `<key's tenant>.x` made ids that
    # the key's tenant check took for its own. Tenant names hold no dot: the tenant is refused.
    key, other = Tenant(tenant_id(KEY_A)), tenant_id(KEY_B)
    name = posing.format(key=key.id, other=other)
    with pytest.raises(InvalidArgument) as refused:
        Client(redis_server.url, tenant=name)
    assert refused.value.field == "tenant"
    with Client(redis_server.url, tenant=key.id) as own, Client(redis_server.url, tenant=other) as neighbour:
        assert key.owns_job(fresh_job_id(own.tenant))
        assert not key.owns_job(fresh_job_id(neighbour.tenant))
