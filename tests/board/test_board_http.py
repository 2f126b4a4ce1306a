"""The board over plain HTTP: its fragments, its job text as Server-Sent Events (keep-alives while a
job waits, resumed after Last-Event-ID), its actions' errors, and its protection: with API keys a
session cookie (HttpOnly, SameSite=Strict, signed, never the key) or the Bearer header, and an
action header no other site's page can send."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, closing

import httpx
import pytest

from producer_client import Client
from tests.board.support import API_KEY, ECHO_QUEUE, KEEPALIVE_S, PARKED_QUEUE, worker_paused
from tests.support.jobs import job_ids_in_queue
from tests.support.poison import LONG_PROMPT

ACTION = {"X-MILI-Board": "1"}


def sse_lines(url: str, seconds: float, headers: dict | None = None) -> list[str]:
    """The lines of an event stream read for `seconds` (or to its end)."""
    lines = []
    deadline = time.monotonic() + seconds
    with httpx.stream("GET", url, headers=headers, timeout=seconds + 5) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            lines.append(line)
            if line == "event: end" or time.monotonic() > deadline:
                break
    return lines


def test_the_overview_fragment_lists_queues_and_workers(open_gateway, board_worker):
    fragment = httpx.get(f"{open_gateway.url}/board/overview")
    assert fragment.status_code == 200 and fragment.headers["content-type"].startswith("text/html")
    assert f'<tr data-queue="{ECHO_QUEUE}">' in fragment.text and f'<tr data-queue="{PARKED_QUEUE}">' in fragment.text
    assert f'<tr data-worker="{board_worker.name}" class="live">' in fragment.text
    assert "<script" not in fragment.text


def test_the_overview_lists_a_tenants_lane_job_with_its_lane_and_tenant(open_gateway, redis_server):
    tenant = f"t{uuid.uuid4().hex[:8]}"
    with Client(redis_server.url, PARKED_QUEUE, tenant=tenant) as client:
        job_id = client.submit("waits in flex", max_tokens=4, service_tier="flex")
        try:
            fragment = httpx.get(f"{open_gateway.url}/board/overview").text
        finally:
            client.cancel(job_id)
    row = fragment.split(f'<tr data-job="{job_id}">', 1)[1].split("</tr>", 1)[0]
    assert f"<td>{PARKED_QUEUE}</td><td>flex</td><td>{tenant}</td><td>–</td>" in row


def test_a_waiting_job_s_stream_keeps_alive_for_many_intervals(open_gateway, redis_server, redis_client):
    with Client(redis_server.url, PARKED_QUEUE) as client:
        job_id = client.submit("waits", max_tokens=4)
        lines = sse_lines(f"{open_gateway.url}/board/job/events?id={job_id}", seconds=KEEPALIVE_S * 6)
        client.cancel(job_id)
    assert lines.count(": keep-alive") >= 4
    assert job_id in job_ids_in_queue(redis_client, PARKED_QUEUE)


def timed_lines(url: str) -> Iterator[tuple[float, str]]:
    """The lines of an event stream as they come, each with its time.time()."""
    with httpx.stream("GET", url, timeout=30) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            yield time.time(), line


# A time bound: the text must come while the job runs. The keep-alive of brisk_gateway is shorter
# than a read of the job's events from the first, which a feed that began a stream() per keep-alive
# made before each new event: its text stopped early and never ended.
@pytest.mark.timing
def test_a_queued_job_s_text_comes_while_it_runs_however_short_the_keep_alive(
    brisk_gateway, board_worker, redis_server
):
    with Client(redis_server.url, ECHO_QUEUE) as client, ExitStack() as stack:
        with worker_paused(board_worker):
            job_id = client.submit(LONG_PROMPT, max_tokens=len(LONG_PROMPT))
            feed = stack.enter_context(closing(timed_lines(f"{brisk_gateway.url}/board/job/events?id={job_id}")))
            assert next(line for _, line in feed if line) == ": keep-alive"  # it follows the job, queued
        grown: list[tuple[float, int]] = []  # (when, the text's length) at each text event
        text = ""
        give_up_at = time.monotonic() + 30  # about three times the job's run on a loaded machine
        for at, line in feed:
            if line.startswith('data: "'):
                text += json.loads(line.removeprefix("data: "))
                grown.append((at, len(text)))
            if line == "event: end" or time.monotonic() > give_up_at:
                break
        finished_at = client.result(job_id, timeout=30).timings.finished_at
    assert text == LONG_PROMPT, f"{len(text)} of {len(LONG_PROMPT)} characters"
    assert len([n for at, n in grown if at < finished_at]) >= 3, grown[:10]


def test_a_job_s_text_resumes_after_the_last_event_id(open_gateway, redis_server, board_worker):
    with Client(redis_server.url, ECHO_QUEUE) as client:
        job_id = client.submit("resume me here", max_tokens=14, stream=True)
        client.result(job_id, timeout=30)
        deltas = list(client.stream(job_id))
    assert len(deltas) >= 2  # the first token goes out alone, at once: there is a middle to resume from
    mid = len(deltas) // 2
    url = f"{open_gateway.url}/board/job/events?id={job_id}"
    whole = sse_lines(url, seconds=10)
    texts = [line.removeprefix("data: ") for line in whole if line.startswith('data: "')]
    assert "".join(json.loads(t) for t in texts) == "resume me here"
    assert [line.removeprefix("id: ") for line in whole if line.startswith("id: ")] == [d.event_id for d in deltas]
    rest = sse_lines(url, seconds=10, headers={"Last-Event-ID": deltas[mid - 1].event_id})
    resumed = [line.removeprefix("id: ") for line in rest if line.startswith("id: ")]
    assert resumed == [d.event_id for d in deltas[mid:]] and rest[-1] == "event: end"
    bad = httpx.get(url, headers={"Last-Event-ID": "not an id"})
    assert bad.status_code == 400


@pytest.mark.parametrize(
    "path, status",
    [
        ("/board/dead/retry?queue=board-echo&letter=no-such-job", 404),
        ("/board/dead/purge?queue=board-echo&letter=1-1", 404),
        ("/board/dead/retry?queue=%7Bbad%7D&letter=x", 400),
        ("/board/job/cancel?id=no-such-job", 404),
    ],
)
def test_actions_on_what_does_not_exist_answer_an_error_and_change_nothing(open_gateway, path, status):
    answer = httpx.post(f"{open_gateway.url}{path}", headers=ACTION)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["message"]


@pytest.mark.parametrize("action", ["retry", "purge"])
def test_a_long_letter_id_is_quoted_cut_in_its_404_and_a_too_long_one_is_a_400_naming_letter(open_gateway, action):
    """The dead-letter actions' 404 quoted the `letter` whole, where the API's 404s cut a name to
    its first 64 characters and an ellipsis; an id past 128 characters was a 400 naming `id`, a
    parameter the action does not have."""
    url = f"{open_gateway.url}/board/dead/{action}"
    letter = "L" * 128
    answer = httpx.post(url, params={"queue": "board-echo", "letter": letter}, headers=ACTION)
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert error["message"] == f"queue 'board-echo' has no dead letter '{'L' * 64}…' (by entry id or job id)", error
    assert (error["type"], error["code"]) == ("invalid_request_error", "not_found")
    answer = httpx.post(url, params={"queue": "board-echo", "letter": "L" * 5000}, headers=ACTION)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["param"], error["code"], len(answer.content) < 1000) == ("letter", "invalid_value", True), error


def test_an_action_without_the_board_s_header_is_forbidden_even_on_an_open_board(
    open_gateway, redis_server, redis_client
):
    with Client(redis_server.url, PARKED_QUEUE) as client:
        job_id = client.submit("keep me", max_tokens=4)
        answer = httpx.post(f"{open_gateway.url}/board/job/cancel?id={job_id}")
        assert answer.status_code == 403
        assert client.status(job_id).status == "queued"
        client.cancel(job_id)


def test_a_job_page_of_an_unknown_job_is_not_found(open_gateway):
    assert httpx.get(f"{open_gateway.url}/board/job?id=no-such-job").status_code == 404


def test_the_board_typed_with_a_trailing_slash_is_redirected_to_it(open_gateway):
    """The app redirects no path with a slash (an API path's is OpenAI's 404 unknown_url): the
    board's own address keeps the redirect a browser's user relies on."""
    answer = httpx.get(f"{open_gateway.url}/board/")
    assert (answer.status_code, answer.headers["location"]) == (307, "/board")
    assert httpx.get(f"{open_gateway.url}/board/", follow_redirects=True).status_code == 200


def test_with_api_keys_the_board_needs_a_session_or_the_bearer_key(keyed_gateway):
    url = keyed_gateway.url
    page = httpx.get(f"{url}/board")
    assert (page.status_code, page.headers["location"]) == (303, "/board/login")
    for path in ("/board/overview", "/board/job/summary?id=x", "/board/job/events?id=x"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
    assert httpx.get(f"{url}/board/overview", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    assert httpx.get(f"{url}/board/overview", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/board/overview", cookies={"mili_board_session": "99999999999.forged"}).status_code == 401

    wrong = httpx.post(f"{url}/board/login", data={"key": "wrong"})
    assert wrong.status_code == 401 and "not one of the gateway" in wrong.text and "set-cookie" not in wrong.headers
    login = httpx.post(f"{url}/board/login", data={"key": API_KEY})
    assert (login.status_code, login.headers["location"]) == (303, "/board")
    cookie = login.headers["set-cookie"]
    assert API_KEY not in cookie
    assert {"HttpOnly", "SameSite=strict", "Path=/board"} <= {part.strip() for part in cookie.split(";")}
    with httpx.Client(base_url=url, cookies=login.cookies) as browser_like:
        assert browser_like.get("/board/overview").status_code == 200
        assert browser_like.post("/board/job/cancel?id=x").status_code == 403  # a session, but no action header
        assert browser_like.get("/v1/models").status_code == 401  # the session is the board's only
        logout = browser_like.post("/board/logout")
        assert logout.status_code == 303 and 'mili_board_session=""' in logout.headers["set-cookie"]


@pytest.mark.parametrize(
    "cookie",
    [
        "²³.abc",
        "١٢٣.x",
        "1.é",
        "99999999999.ǅ",
        "no-dot",
        ".",
        "1." + "g" * 64,
        "9" * 40 + "." + "a" * 64,
        "",
    ],
)
def test_a_malformed_session_cookie_is_a_401_never_a_500(keyed_gateway, cookie):
    # A browser sends a cookie's bytes as they are (UTF-8 here), whatever the server decodes them to.
    response = httpx.get(
        f"{keyed_gateway.url}/board/overview", headers={"Cookie": f"mili_board_session={cookie}".encode()}
    )
    assert response.status_code == 401, response.text


@pytest.mark.parametrize("job_id", ["has space", "{tag}", "x" * 200, "-lead"])
def test_a_bad_id_on_the_event_stream_is_a_400_before_the_stream_starts(open_gateway, job_id):
    response = httpx.get(f"{open_gateway.url}/board/job/events", params={"id": job_id})
    assert response.status_code == 400 and response.headers["content-type"].startswith("application/json")
    assert response.json()["error"]["param"] == "job_id"
