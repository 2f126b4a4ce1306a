"""What a request passes before the gateway reads its body: its key (an unauthenticated 16 MiB
upload is refused before any of it is read: nothing is spooled to disk, memory does not grow),
its size (a Content-Length over the limit is refused at once with 413; a chunked body is cut off
once it passes the limit, and what the gateway held stays under the limit plus a small constant),
and its type (a JSON route takes application/json only: a cross-site "simple" request cannot
enqueue work), its time (a body not whole within body_timeout_s is answered 408 and its connection
closed, read whole by a client still sending; a head not whole within header_timeout_s too, and a connection that sends nothing is
closed; a head over 64 KiB is refused with 431 as it passes the limit). No CORS is granted unless configured; the board's actions need their header; an open gateway
answers a Host a page rebound by DNS to it cannot name only."""

from __future__ import annotations

import json
import re
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from gateway.http_protocol import LINGER_S
from tests.gateway.support import ResourceWatch, raw_request, read_answer
from tests.support.gateways import GatewayProcess
from tests.support.jobs import job_ids
from worker.embedded_redis import EmbeddedRedis, free_port

KEY = "edge-key"
UPLOAD_LIMIT = 1 << 20
JSON_LIMIT = 64 << 10
MIB = 1 << 20
# What the gateway may hold beyond a limit: one read of the socket, the interpreter's own churn.
SLACK = 4 * MIB
ORIGIN = "https://app.example"
BODY_TIMEOUT_S = 2.0
HEADER_TIMEOUT_S = 2.0
BOUNDARY = "edgeboundary"


@pytest.fixture(scope="module")
def spool_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("spool")


@pytest.fixture(scope="module")
def edge_gateway(redis_server, tmp_path_factory, spool_dir):
    gateway = GatewayProcess(
        redis_server.url,
        tmp_path_factory.mktemp("edge"),
        "--api-keys",
        json.dumps([KEY]),
        "--batch-max-file-bytes",
        str(UPLOAD_LIMIT),
        "--max-json-bytes",
        str(JSON_LIMIT),
        "--cors-origins",
        json.dumps([ORIGIN]),
        "--auth-failures-per-minute",
        "1000",
        "--body-timeout-s",
        str(BODY_TIMEOUT_S),
        "--header-timeout-s",
        str(HEADER_TIMEOUT_S),
        env={"TMPDIR": str(spool_dir)},
    ).start()
    yield gateway
    gateway.stop()


def upload_head(length: int | None, key: str | None = None) -> dict[str, str]:
    headers = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}
    if length is not None:
        headers["Content-Length"] = str(length)
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return headers


def upload_chunks(total: int, chunk: int = 64 << 10):
    """A multipart body of one file part `total` bytes long (never closed: it is cut off first)."""
    yield (
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{BOUNDARY}\r\n'
        'Content-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}}\n'
    for _ in range(total // chunk):
        yield (line * (chunk // len(line) + 1))[:chunk]


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_an_unauthenticated_upload_is_refused_before_any_of_it_is_read(edge_gateway, spool_dir, chunked):
    with ResourceWatch(edge_gateway.process.pid, spool_dir) as watch:
        status, body, _ = raw_request(
            edge_gateway.port,
            "POST",
            "/v1/files",
            upload_head(None if chunked else 16 * MIB),
            upload_chunks(16 * MIB),
            chunked=chunked,
        )
    assert status == 401 and error_of(body)["code"] == "invalid_api_key"
    assert watch.max_spooled == 0
    assert watch.max_rss_growth < SLACK, watch.max_rss_growth


def test_an_upload_whose_length_is_over_the_limit_is_refused_at_once(edge_gateway, spool_dir):
    with ResourceWatch(edge_gateway.process.pid, spool_dir) as watch:
        status, body, sent = raw_request(
            edge_gateway.port, "POST", "/v1/files", upload_head(16 * MIB, KEY), upload_chunks(16 * MIB)
        )
    assert status == 413 and error_of(body)["code"] == "request_too_large"
    assert (
        error_of(body)["type"] == "invalid_request_error" and str(UPLOAD_LIMIT + 64 * 1024) in error_of(body)["message"]
    )
    assert sent == 0 and watch.max_spooled == 0


def test_a_chunked_upload_is_cut_off_once_it_passes_the_limit(edge_gateway, spool_dir):
    with ResourceWatch(edge_gateway.process.pid, spool_dir) as watch:
        status, body, sent = raw_request(
            edge_gateway.port, "POST", "/v1/files", upload_head(None, KEY), upload_chunks(16 * MIB), chunked=True
        )
    assert status == 413 and error_of(body)["code"] == "request_too_large"
    assert sent < 16 * MIB
    assert watch.max_spooled <= UPLOAD_LIMIT + SLACK, watch.max_spooled
    assert watch.max_rss_growth < UPLOAD_LIMIT + SLACK, watch.max_rss_growth


def test_a_json_body_over_the_limit_is_refused_whether_announced_or_chunked(edge_gateway, spool_dir):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    big = b'{"model": "echo", "prompt": "' + b"x" * (64 * MIB)
    chunks = [big[i : i + (64 << 10)] for i in range(0, len(big), 64 << 10)]
    status, body, sent = raw_request(
        edge_gateway.port, "POST", "/v1/completions", {**headers, "Content-Length": str(len(big))}, chunks
    )
    assert (status, error_of(body)["code"], sent) == (413, "request_too_large", 0)
    with ResourceWatch(edge_gateway.process.pid, spool_dir) as watch:
        status, body, sent = raw_request(edge_gateway.port, "POST", "/v1/completions", headers, chunks, chunked=True)
    assert (status, error_of(body)["code"]) == (413, "request_too_large")
    assert sent < len(big)
    assert watch.max_rss_growth < JSON_LIMIT + SLACK, watch.max_rss_growth


def test_the_board_login_reads_a_bounded_form(edge_gateway, spool_dir):
    form = b"key=" + b"k" * (16 * MIB)
    with ResourceWatch(edge_gateway.process.pid, spool_dir) as watch:
        status, body, _ = raw_request(
            edge_gateway.port,
            "POST",
            "/board/login",
            {"Content-Type": "application/x-www-form-urlencoded"},
            [form[i : i + 65536] for i in range(0, len(form), 65536)],
            chunked=True,
        )
    assert (status, error_of(body)["code"]) == (413, "request_too_large")
    assert watch.max_rss_growth < SLACK, watch.max_rss_growth


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_a_json_route_takes_json_only_and_enqueues_nothing_else(edge_gateway, redis_client, content_type):
    before = job_ids(redis_client)
    body = json.dumps({"model": "echo", "prompt": "cross-site", "max_tokens": 4}).encode()
    # A page of the gateway's own origin must send JSON too; one of another site, which a browser
    # too old for Sec-Fetch-Site marks by its Origin alone, is refused for where it comes from first.
    refusals = {edge_gateway.url: (415, "unsupported_media_type"), "https://evil.example": (403, "cross_site_request")}
    for origin, refusal in refusals.items():
        headers = {"Authorization": f"Bearer {KEY}", "Origin": origin}
        if content_type:
            headers["Content-Type"] = content_type
        for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/v1/batches"):
            response = httpx.post(f"{edge_gateway.url}{path}", content=body, headers=headers)
            assert (response.status_code, response.json()["error"]["code"]) == refusal, (origin, path)
            assert "access-control-allow-origin" not in response.headers
    assert job_ids(redis_client) <= before


def test_cors_is_granted_to_configured_origins_only(edge_gateway, redis_server):
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    allowed = httpx.options(f"{edge_gateway.url}/v1/completions", headers={"Origin": ORIGIN, **preflight})
    refused = httpx.options(
        f"{edge_gateway.url}/v1/completions", headers={"Origin": "https://evil.example", **preflight}
    )
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in refused.headers
    # The official SDK in a page (openai-node's dangerouslyAllowBrowser sends the same) asks for
    # its own headers in the preflight: each one refused would stop every request it makes.
    sdk = openai.OpenAI(base_url=f"{edge_gateway.url}/v1", api_key=KEY)
    asked = [h.lower() for h in sdk.default_headers if h.lower().startswith(("x-", "openai-"))]
    asked += ["x-stainless-retry-count", "x-stainless-timeout", "authorization", "content-type"]
    sdk.close()
    sdk_preflight = httpx.options(
        f"{edge_gateway.url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": ",".join(asked),
        },
    )
    assert sdk_preflight.status_code == 200, sdk_preflight.text
    assert sdk_preflight.headers["access-control-allow-origin"] == ORIGIN
    # A page reads the headers a retry waits on (the SDKs' retry-after-ms), none CORS-safelisted.
    answer = httpx.get(f"{edge_gateway.url}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    exposed = {name.strip() for name in answer.headers["access-control-expose-headers"].split(",")}
    assert {"retry-after", "retry-after-ms", "x-request-id", "x-ratelimit-reset-requests"} <= exposed


def test_an_open_gateway_grants_no_cors_and_its_board_actions_need_their_header(redis_server, tmp_path):
    gateway = GatewayProcess(redis_server.url, tmp_path).start()
    try:
        preflight = httpx.options(
            f"{gateway.url}/v1/completions",
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert "access-control-allow-origin" not in preflight.headers
        for origin, status in ((gateway.url, 415), ("https://evil.example", 403)):
            simple = httpx.post(
                f"{gateway.url}/v1/completions", content=b"{}", headers={"Origin": origin, "Content-Type": "text/plain"}
            )
            assert simple.status_code == status and "access-control-allow-origin" not in simple.headers
        action = httpx.post(f"{gateway.url}/board/job/cancel?id=anything", headers={"Origin": "https://evil.example"})
        assert action.status_code == 403
    finally:
        gateway.stop()


def test_a_page_of_another_site_cannot_upload_or_act_through_a_browser(tmp_path):
    """A form's multipart POST is a "simple" request: no CORS preflight, so a page of any site could
    upload batch files (each up to the file limit, as often as it liked) to an open gateway through
    the browser of anyone who reached it; its 200 was not read, but the file was stored. A browser
    marks such a request (Sec-Fetch-Site, which no page can set): any that may change something is
    now a 403 unless cors_origins grants the page's origin. The gateway's own pages, a typed URL,
    and the SDKs (no Sec-Fetch-Site) are served as before; GETs too (a page cannot read them). A
    Redis of its own: the files listed are this test's."""
    with EmbeddedRedis(port=free_port()) as server:
        cross_site_uploads(GatewayProcess(server.url, tmp_path).start())


def cross_site_uploads(gateway: GatewayProcess) -> None:
    line = json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}).encode()

    def upload(**headers: str) -> httpx.Response:
        form = {"file": ("a.jsonl", line + b"\n")}
        return httpx.post(f"{gateway.url}/v1/files", files=form, data={"purpose": "batch"}, headers=headers)

    evil = {"Origin": "https://evil.example"}
    try:
        for site in ("cross-site", "same-site"):
            refused = upload(**evil, **{"Sec-Fetch-Site": site})
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["code"] == "cross_site_request"
            cancel = httpx.post(
                f"{gateway.url}/v1/batches/batch_{'0' * 32}/cancel", headers={**evil, "Sec-Fetch-Site": site}
            )
            assert cancel.status_code == 403, cancel.text
        sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        assert [f.id for f in sdk.files.list()] == []
        own = upload(**{"Origin": gateway.url, "Sec-Fetch-Site": "same-origin"})
        assert own.status_code == 200, own.text
        assert upload(**{"Sec-Fetch-Site": "none"}).status_code == 200
        assert upload().status_code == 200
        read = httpx.get(f"{gateway.url}/v1/files", headers={**evil, "Sec-Fetch-Site": "cross-site"})
        assert read.status_code == 200 and "access-control-allow-origin" not in read.headers
        assert len(sdk.files.list().data) == 3
        sdk.close()
    finally:
        gateway.stop()


def test_a_page_of_an_origin_cors_origins_grants_may_act(edge_gateway):
    body = json.dumps({"model": "echo", "prompt": "granted", "max_tokens": 1})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "Sec-Fetch-Site": "cross-site"}
    granted = httpx.post(f"{edge_gateway.url}/v1/completions", content=body, headers={**headers, "Origin": ORIGIN})
    assert granted.status_code != 403 and granted.headers["access-control-allow-origin"] == ORIGIN, granted.text
    other = httpx.post(
        f"{edge_gateway.url}/v1/completions", content=body, headers={**headers, "Origin": "https://evil.example"}
    )
    assert other.status_code == 403 and other.json()["error"]["code"] == "cross_site_request"


def test_a_browser_that_sends_no_sec_fetch_site_is_judged_by_its_origin_against_the_host(tmp_path):
    """Browsers older than Sec-Fetch-Site (Safari before 16.4, any engine before 2020) send a
    cross-origin POST's Origin, not its mark: such a page's multipart upload went through as the
    SDKs' did. Now, as Go's CrossOriginProtection answers, a request that may change something,
    with no Sec-Fetch-Site and an Origin whose host is not the Host header's, is a 403 (the `null`
    origin of a sandboxed frame or a file too). No Origin: no browser's cross-origin request, served;
    GETs are served as before. A Redis of its own: the files listed are this test's."""
    with EmbeddedRedis(port=free_port()) as server:
        gateway = GatewayProcess(server.url, tmp_path).start()
        line = json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": {}}).encode()

        def upload(**headers: str) -> httpx.Response:
            form = {"file": ("a.jsonl", line + b"\n")}
            return httpx.post(f"{gateway.url}/v1/files", files=form, data={"purpose": "batch"}, headers=headers)

        try:
            for origin in ("https://evil.example", f"http://localhost:{gateway.port}", "null"):
                refused = upload(Origin=origin)
                assert refused.status_code == 403, (origin, refused.text)
                assert refused.json()["error"]["code"] == "cross_site_request"
                cancel = httpx.post(f"{gateway.url}/v1/batches/batch_{'0' * 32}/cancel", headers={"Origin": origin})
                assert cancel.status_code == 403, (origin, cancel.text)
            sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
            assert [f.id for f in sdk.files.list()] == []
            assert upload(Origin=gateway.url).status_code == 200
            assert upload().status_code == 200
            read = httpx.get(f"{gateway.url}/v1/files", headers={"Origin": "https://evil.example"})
            assert read.status_code == 200 and len(read.json()["data"]) == 2
            sdk.close()
        finally:
            gateway.stop()


def test_an_origin_cors_origins_grants_may_act_from_a_browser_without_sec_fetch_site(edge_gateway):
    body = json.dumps({"model": "echo", "prompt": "granted", "max_tokens": 1})
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    granted = httpx.post(f"{edge_gateway.url}/v1/completions", content=body, headers={**headers, "Origin": ORIGIN})
    assert granted.status_code != 403 and granted.headers["access-control-allow-origin"] == ORIGIN, granted.text
    other = httpx.post(
        f"{edge_gateway.url}/v1/completions", content=body, headers={**headers, "Origin": "https://evil.example"}
    )
    assert other.status_code == 403 and other.json()["error"]["code"] == "cross_site_request"


def test_an_open_gateway_answers_only_hosts_a_rebound_page_cannot_name(redis_server, redis_client, tmp_path):
    """DNS rebinding: a page of evil.example whose name the attacker then points at 127.0.0.1 is of
    the same origin as the gateway on the developer's loopback, so it sends any header (the board's
    X-MILI-Board, application/json) and reads the answers, with no CORS asked. Its requests name
    its own host: an open gateway answers a Host that is an address, localhost, or a listed name."""
    gateway = GatewayProcess(redis_server.url, tmp_path, "--allowed-hosts", '["gw.internal"]').start()
    try:
        before = job_ids(redis_client)
        rebound = {"Host": f"evil.example:{gateway.port}"}
        job = {"model": "nobody", "prompt": "hi", "max_tokens": 1}
        for answer in (
            httpx.get(f"{gateway.url}/v1/models", headers=rebound),
            httpx.post(f"{gateway.url}/v1/completions", json=job, headers=rebound),
            httpx.get(f"{gateway.url}/board/", headers=rebound),
            httpx.post(f"{gateway.url}/board/job/cancel?id=anything", headers={**rebound, "X-MILI-Board": "1"}),
            httpx.get(f"{gateway.url}/v1/models", headers={"Host": "localhost.evil.example"}),
        ):
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"]["code"] == "host_not_allowed"
        assert job_ids(redis_client) <= before
        for host in (
            "127.0.0.1",
            f"127.0.0.1:{gateway.port}",
            "localhost",
            f"LocalHost.:{gateway.port}",
            "board.localhost",
            f"[::1]:{gateway.port}",
            "10.1.2.3",
            f"gw.internal:{gateway.port}",
        ):
            answer = httpx.get(f"{gateway.url}/v1/models", headers={"Host": host})
            assert answer.status_code == 200, (host, answer.text)
    finally:
        gateway.stop()


def test_a_keyed_gateway_answers_any_host_its_keys_guard_it(redis_server, tmp_path):
    """A rebound page has no key, and no board cookie (the browser keeps those per host): a keyed
    gateway serves any Host, as one behind an ingress under its public name must be."""
    gateway = GatewayProcess(redis_server.url, tmp_path, "--api-keys", json.dumps([KEY])).start()
    try:
        named = {"Host": "api.example.com"}
        assert (
            httpx.get(f"{gateway.url}/v1/models", headers={**named, "Authorization": f"Bearer {KEY}"}).status_code
            == 200
        )
        assert httpx.get(f"{gateway.url}/v1/models", headers=named).status_code == 401
    finally:
        gateway.stop()


def read_to_the_end(sock: socket.socket) -> bytes:
    """What the gateway sends until it ends the connection. A piece sent in the instant it answered
    and closed reaches a closed socket, whose kernel resets the connection (seen in CI at load): it
    is closed all the same, and what arrived before the reset has been read."""
    answer = b""
    try:
        while more := sock.recv(65536):
            answer += more
    except ConnectionResetError:
        pass
    return answer


def request_in_pieces(port: int, pieces: list[bytes], every_s: float, announced: int | None = None) -> dict:
    """A JSON POST whose Content-Length says `announced` bytes (those of `pieces` if None), its
    body sent a piece every `every_s` until the gateway answers; then read to the connection's end
    (a connection the gateway kept open fails the read by its socket timeout)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    length = sum(map(len, pieces)) if announced is None else announced
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {length}\r\n\r\n"
    )
    started = time.monotonic()
    sock.sendall(head.encode())
    sent = 0
    for piece in pieces:
        if select.select([sock], [], [], every_s)[0]:
            break
        sock.sendall(piece)
        sent += len(piece)
    select.select([sock], [], [], 30)
    answered_s = time.monotonic() - started
    answer = read_to_the_end(sock)
    closed_s = time.monotonic() - started
    assert answer, "the connection ended with no answer"
    sock.close()
    head_part, _, body = answer.partition(b"\r\n\r\n")
    return {
        "status": int(head_part.split()[1]),
        "body": body,
        "sent": sent,
        "answered_s": answered_s,
        "closed_s": closed_s,
    }


def test_a_body_not_whole_in_time_is_answered_408_and_its_connection_closed_while_others_are_served(edge_gateway):
    # Three clients announce 400 bytes and send one every 0.25 s: 100 s of body, past the timeout
    # many times over. Each is answered 408 at the timeout and its connection closed; meanwhile
    # a body sent in pieces that arrive in time is read whole (its error is about its content),
    # and the gateway serves other requests.
    dribble = [b" "] * 400
    in_time = [b'{"model": "no-worker-serves-this", ', b'"prompt": "hi", ', b'"max_tokens": 4}']
    with ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(request_in_pieces, edge_gateway.port, dribble, 0.25, 400) for _ in range(3)]
        ontime = pool.submit(request_in_pieces, edge_gateway.port, in_time, 0.4)
        models = httpx.get(f"{edge_gateway.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        answers = [future.result() for future in slow]
        read_whole = ontime.result()
    assert models.status_code == 200
    for answer in answers:
        assert (answer["status"], error_of(answer["body"])["code"]) == (408, "request_timeout")
        assert BODY_TIMEOUT_S - 0.1 <= answer["answered_s"] < BODY_TIMEOUT_S + 2.0, answer
        assert answer["sent"] < 400 * BODY_TIMEOUT_S / 100 + 8, answer  # about one a 0.25 s until the answer
        assert answer["closed_s"] - answer["answered_s"] < 1.0, answer  # closed with the answer, not left open
    # No worker serves that model (whichever workers other tests started on this Redis): an answer
    # about the body's model is one about a body read whole.
    assert (read_whole["status"], error_of(read_whole["body"])["code"]) == (404, "model_not_found"), read_whole
    assert read_whole["sent"] == sum(map(len, in_time))


def body_sent_on_regardless(port: int, until_s: float) -> dict:
    """A JSON POST announcing its limit whose body comes a KiB every 0.05 s for `until_s`, whatever the
    gateway answers meanwhile (a client writing its body before it reads, as most do); then its
    answer, read to the connection's end. `reset`: the read ended by a reset."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: {JSON_LIMIT}\r\n\r\n".encode()
    )
    started = time.monotonic()
    answer, reset = b"", False
    try:
        while time.monotonic() - started < until_s:
            sock.sendall(b" " * 1024)
            time.sleep(0.05)
        while more := sock.recv(65536):
            answer += more
    except (ConnectionResetError, BrokenPipeError):
        reset = True
    sock.close()
    head_part, _, body = answer.partition(b"\r\n\r\n")
    return {"status": int(head_part.split()[1]) if answer else None, "body": body, "reset": reset}


@pytest.mark.parametrize("announced", [True, False], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_answered_413_and_its_connection_closed(edge_gateway, announced):
    """The rest of a body refused for its size is never read: its connection closes with the 413,
    as with a 408 (the close lingers, so that a client still sending reads it whole), where it stayed
    open and the gateway read the body it had refused to its end, however long (a Content-Length
    over the limit: as long as the client kept sending). A request announcing four times the limit
    sends a KiB every 0.05 s until answered; a chunked one, 8 KiB every 0.05 s, is refused once past
    the limit."""
    if announced:
        answer = request_in_pieces(edge_gateway.port, [b" " * 1024] * 400, 0.05, announced=4 * JSON_LIMIT)
        assert answer["sent"] < 4 * JSON_LIMIT, answer
    else:
        answer = chunked_in_pieces(edge_gateway.port, [b" " * 8192] * 400, 0.05)
    assert (answer["status"], error_of(answer["body"])["code"]) == (413, "request_too_large"), answer
    assert answer["closed_s"] - answer["answered_s"] < LINGER_S + 1.0, answer  # closed with the answer


def answered_while_sending(port: int, head: str, chunked: bool) -> dict:
    """A request whose body comes a KiB every 0.05 s whatever the gateway answers (a client writing
    its body before it reads, as most do), read as it comes, until the gateway ends the connection
    or LINGER_S + 3 s after its answer began. `ended_s`: how long after the answer's first byte the
    connection ended (None: it did not by then)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(head.encode() + b"\r\n")
    piece = b"400\r\n" + b" " * 1024 + b"\r\n" if chunked else b" " * 1024
    answer, answered_at, ended_at = b"", None, None
    try:
        while answered_at is None or time.monotonic() - answered_at < LINGER_S + 3.0:
            if not select.select([sock], [], [], 0.05)[0]:
                sock.sendall(piece)
            elif more := sock.recv(65536):
                answered_at = answered_at or time.monotonic()
                answer += more
            else:
                ended_at = time.monotonic()
                break
    except (ConnectionResetError, BrokenPipeError):
        ended_at = time.monotonic()  # a piece sent as the gateway's linger ended: see read_to_the_end
    sock.close()
    assert answered_at is not None, f"the connection ended with no answer: {answer!r}"
    head_part, _, body = answer.partition(b"\r\n\r\n")
    lines = head_part.decode("latin-1").lower().split("\r\n")
    return {
        "status": int(lines[0].split()[1]),
        "headers": dict(line.split(": ", 1) for line in lines[1:]),
        "body": body,
        "ended_s": None if ended_at is None else ended_at - answered_at,
    }


JSON_HEAD = "Content-Type: application/json\r\n"
WITH_KEY = f"Authorization: Bearer {KEY}\r\n"
CHUNKED = "Transfer-Encoding: chunked\r\n"
UPLOAD = f"Content-Type: multipart/form-data; boundary={BOUNDARY}\r\nContent-Length: {UPLOAD_LIMIT}\r\n"


@pytest.mark.parametrize(
    ("request_head", "chunked", "status"),
    [
        (f"POST /v1/files HTTP/1.1\r\n{UPLOAD}", False, 401),
        (f"POST /v1/completions HTTP/1.1\r\n{JSON_HEAD}{CHUNKED}", True, 401),
        (f"POST /v1/completions HTTP/1.1\r\nContent-Type: text/plain\r\n{WITH_KEY}{CHUNKED}", True, 415),
        (f"POST /v1/nowhere HTTP/1.1\r\n{JSON_HEAD}{WITH_KEY}{CHUNKED}", True, 404),
        (f"PUT /generate HTTP/1.1\r\n{JSON_HEAD}{WITH_KEY}Content-Length: {JSON_LIMIT}\r\n", False, 405),
    ],
    ids=["401-upload-length", "401-chunked", "415-chunked", "404-chunked", "405-length"],
)
def test_an_answer_decided_before_the_body_is_read_closes_its_connection_and_arrives_whole(
    edge_gateway, request_head, chunked, status
):
    """A request refused from its head alone (no key, not JSON, no such route or method) is answered
    before its body is read; its connection now closes with the answer (lingering, so that a client
    still sending reads it whole), where it stayed open and uvicorn read and dropped the rest of
    the body for as long as the client sent it: a chunked body, or an upload's, for ever."""
    answer = answered_while_sending(edge_gateway.port, f"{request_head}Host: 127.0.0.1\r\n", chunked)
    assert answer["status"] == status, answer
    assert len(answer["body"]) == int(answer["headers"]["content-length"]), answer  # the answer whole
    assert json.loads(answer["body"])["error"]["type"] == "invalid_request_error", answer
    assert answer["headers"]["connection"] == "close", answer
    assert answer["ended_s"] is not None and answer["ended_s"] < LINGER_S + 1.0, answer


def test_a_refusal_of_a_request_without_a_body_keeps_its_connection(edge_gateway):
    """Nothing is left to read after a bodiless request: its 401 keeps the connection alive (HTTP/1.1's
    default), and the next request on it is served."""
    with socket.create_connection(("127.0.0.1", edge_gateway.port), timeout=10) as sock:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        refused = read_answer(sock)
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n{WITH_KEY}\r\n".encode())
        served = read_answer(sock)
    assert (refused[0], json.loads(refused[1])["error"]["code"]) == (401, "invalid_api_key")
    assert (served[0], json.loads(served[1])["object"]) == (200, "list")


def chunked_in_pieces(port: int, pieces: list[bytes], every_s: float) -> dict:
    """request_in_pieces, with a chunked body: each piece a chunk."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
    )
    started = time.monotonic()
    for piece in pieces:
        if select.select([sock], [], [], every_s)[0]:
            break
        sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
    select.select([sock], [], [], 30)
    answered_s = time.monotonic() - started
    answer = read_to_the_end(sock)
    closed_s = time.monotonic() - started
    sock.close()
    head_part, _, body = answer.partition(b"\r\n\r\n")
    return {"status": int(head_part.split()[1]), "body": body, "answered_s": answered_s, "closed_s": closed_s}


def test_a_client_still_sending_its_body_reads_the_whole_408(edge_gateway):
    # The gateway closed its side with the 408: the client's further pieces, and those unread on
    # the gateway's side, reset the connection, and a client reading after it had written lost
    # the answer. The gateway now drops what comes for LINGER_S after its answer before closing:
    # a client that keeps sending for half of that past the timeout reads the 408 whole.
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(body_sent_on_regardless, [edge_gateway.port] * 4, [BODY_TIMEOUT_S + LINGER_S / 2] * 4))
    for answer in answers:
        assert not answer["reset"], answer
        assert (answer["status"], error_of(answer["body"])["code"]) == (408, "request_timeout"), answer


def head_in_pieces(port: int, pieces: list[bytes], every_s: float) -> dict:
    """A connection that sends `pieces` of a request's head, one every `every_s`, until the gateway
    answers or closes; then read to the connection's end. status None: closed with no answer."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    started = time.monotonic()
    for piece in pieces:
        if select.select([sock], [], [], every_s)[0]:
            break
        sock.sendall(piece)
    select.select([sock], [], [], 30)
    answer = read_to_the_end(sock)
    closed_s = time.monotonic() - started
    sock.close()
    head_part, _, body = answer.partition(b"\r\n\r\n")
    return {"status": int(head_part.split()[1]) if answer else None, "body": body, "closed_s": closed_s}


def two_requests_apart(port: int, pause_s: float) -> list[int]:
    """Two GETs on one connection, `pause_s` apart: the statuses of both."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    statuses = []
    for i in range(2):
        if i:
            time.sleep(pause_s)
        sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n\r\n".encode())
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
        head_part, _, body = answer.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1]) for line in head_part.split(b"\r\n") if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            body += sock.recv(65536)
        statuses.append(int(head_part.split()[1]))
    sock.close()
    return statuses


def test_a_head_not_whole_in_time_is_answered_408_and_a_silent_connection_closed_while_others_are_served(
    edge_gateway,
):
    # A slowloris: connections that send no byte, or part of a head and then nothing, or a header
    # line every 0.25 s (100 of them: 25 s of head, past the timeout many times over), were held
    # for as long as their clients kept them open. Each now ends at the timeout; meanwhile a
    # connection that waits between two requests longer than the timeout keeps being served (the
    # deadline is its head's, not its life's).
    begun = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    drip = [begun] + [f"X-Slow-{i}: {i}\r\n".encode() for i in range(100)]
    with ThreadPoolExecutor(4) as pool:
        silent = pool.submit(head_in_pieces, edge_gateway.port, [], 0.25)
        partial = pool.submit(head_in_pieces, edge_gateway.port, [begun], 0.25)
        dripping = pool.submit(head_in_pieces, edge_gateway.port, drip, 0.25)
        apart = pool.submit(two_requests_apart, edge_gateway.port, HEADER_TIMEOUT_S + 0.5)
        models = httpx.get(f"{edge_gateway.url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
        answers = {"silent": silent.result(), "partial": partial.result(), "dripping": dripping.result()}
        statuses = apart.result()
    assert models.status_code == 200
    assert statuses == [200, 200]
    assert answers["silent"]["status"] is None, answers["silent"]
    for name in ("partial", "dripping"):
        assert (answers[name]["status"], error_of(answers[name]["body"])["code"]) == (408, "request_timeout"), answers
    for answer in answers.values():
        assert HEADER_TIMEOUT_S - 0.1 <= answer["closed_s"] < HEADER_TIMEOUT_S + 2.0, answers


def test_a_head_over_its_limit_that_ends_in_the_read_that_passes_it_is_refused_too(edge_gateway):
    # The bytes were counted after the parser had read them, and a head that it found whole in
    # that read was served: heads of 66,000 and 70,000 bytes sent at once were answered 200.
    for header_bytes in (66_000, 70_000, 200_000):
        answer = head_sent_whole(edge_gateway.port, header_bytes)
        assert answer["status"] == 431, (header_bytes, answer)
        assert error_of(answer["body"])["code"] == "headers_too_large"
    assert head_sent_whole(edge_gateway.port, 60_000)["status"] == 200


def test_a_431_answered_before_any_request_carries_a_request_id_as_every_answer(edge_gateway):
    """docs/http-api.md: every response carries x-request-id. The protocol's own answers (a head too
    large or too slow), written before the app has a request, had none."""
    head = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nX-Big: ".encode()
    with socket.create_connection(("127.0.0.1", edge_gateway.port), timeout=30) as sock:
        sock.sendall(head + b"a" * 70_000 + b"\r\n\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
    status_line, *headers = answer.partition(b"\r\n\r\n")[0].decode().split("\r\n")
    assert status_line.split()[1] == "431"
    assert any(re.fullmatch(r"x-request-id: [0-9a-f]{32}", line) for line in headers), headers


def head_sent_whole(port: int, header_bytes: int) -> dict:
    """A GET whose one X-Big header has `header_bytes` bytes, its head sent in one write; its answer."""
    head = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nX-Big: ".encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + b"a" * header_bytes + b"\r\n\r\n")
        status, body = read_answer(sock)
    return {"status": status, "body": body}


def head_of_size(port: int, header_bytes: int, piece: int = 64 << 10) -> dict:
    """A GET whose one X-Big header has `header_bytes` bytes, sent a piece at a time until the
    gateway answers; then its answer, read to its length (the gateway may close after)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nX-Big: ".encode())
    sent = 0
    while sent < header_bytes and not select.select([sock], [], [], 0.005)[0]:
        sock.sendall(b"a" * min(piece, header_bytes - sent))
        sent += min(piece, header_bytes - sent)
    if sent == header_bytes:
        sock.sendall(b"\r\n\r\n")
    status, body = read_answer(sock)
    sock.close()
    return {"status": status, "body": body, "sent": sent}


def test_a_head_over_its_limit_is_refused_431_and_the_gateway_holds_no_more_of_it(edge_gateway, spool_dir):
    # uvicorn bounds no head: a header sent for as long as a client liked was held whole (170 MiB
    # of one header in 2.5 s grew the gateway by as much). A head of 32 KiB (a big cookie) is served.
    with ResourceWatch(edge_gateway.process.pid, spool_dir) as watch:
        huge = head_of_size(edge_gateway.port, 64 * MIB)
    assert (huge["status"], error_of(huge["body"])["code"]) == (431, "headers_too_large"), huge["body"]
    assert huge["sent"] < 64 * MIB
    assert watch.max_rss_growth < SLACK, watch.max_rss_growth
    assert head_of_size(edge_gateway.port, 32 << 10)["status"] == 200


def a_head_answer(port: int, head: str) -> tuple[int, bytes]:
    """The answer to a request of `head` alone (request line and header lines), sent raw."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head.encode() + b"\r\n")
        return read_answer(sock)


def test_an_http_1_1_request_without_one_host_line_is_a_400(edge_gateway):
    """RFC 9112 3.2: a server answers 400 to an HTTP/1.1 request that has no Host, or more than one
    Host line (which names the request's target is then unsaid); HTTP/1.0 had no Host to send."""
    key = f"Authorization: Bearer {KEY}\r\n"
    for head in (
        f"GET /v1/models HTTP/1.1\r\n{key}",
        f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n{key}",
    ):
        status, body = a_head_answer(edge_gateway.port, head)
        assert status == 400, (head, body)
        assert json.loads(body)["error"]["code"] == "invalid_host", body
    assert a_head_answer(edge_gateway.port, f"GET /v1/models HTTP/1.0\r\n{key}")[0] == 200
    assert a_head_answer(edge_gateway.port, f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n{key}")[0] == 200
