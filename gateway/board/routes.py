"""The board's routes, under /board. Pages and fragments are server-rendered HTML; a page reads
its fragment again every REFRESH_S, and a job page follows the job's text as Server-Sent Events.
Job ids and queue names go in the query string: both may hold a `/`."""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, Depends, FastAPI, Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from gateway.api_keys import AuthFailures, bearer_key
from gateway.board.auth import ACTION_HEADER, COOKIE, SESSION_S, BoardAuth
from gateway.board.feed import text_events
from gateway.board.pages import environment
from gateway.board.views import JOBS_SHOWN, BoardReader
from gateway.edge import client_address
from gateway.errors import WWW_AUTHENTICATE, retry_after_headers, unauthorized
from gateway.settings import GatewaySettings
from gateway.streaming import EventStream
from openai_format.errors import APIError, echoed, not_found
from producer_client import AsyncClient, JobNotFound
from producer_client.dead_letters import DeadLetterNotFound, NotRetryable
from producer_client.keys import check_name
from producer_client.validation import check_event_id, check_job_id

log = logging.getLogger("gateway.board")


def add_board(app: FastAPI, client: AsyncClient, settings: GatewaySettings, failures: AuthFailures) -> None:
    board = Board(
        BoardAuth(board_keys(settings), tenant_keys=tenant_keys(settings)),
        BoardReader(client, set(settings.routed_queues())),
    )
    router = APIRouter(prefix="/board")
    add_overview_routes(router, board)
    add_job_routes(router, board, client, settings.keepalive_s)
    add_dead_letter_routes(router, client, board)
    add_session_routes(router, board, failures)
    app.include_router(router)


def board_keys(settings: GatewaySettings) -> list[str]:
    """The keys the board lets in: the board shows every tenant's jobs and dead letters, and
    cancels, retries and purges them, so where there are `admin_api_keys` only they (a tenant's
    key, which sees its own jobs only through the API, is refused here); else every key, as every
    key is then an operator's."""
    return list(settings.admin_api_keys) or list(settings.api_keys)


def tenant_keys(settings: GatewaySettings) -> list[str]:
    """The gateway's keys that board_keys leaves out: right keys, refused here with a 403."""
    admitted = set(board_keys(settings))
    return [k for k in [*settings.api_keys, *settings.admin_api_keys] if k not in admitted]


def admin_key_required() -> APIError:
    return APIError(
        403,
        "the board needs an admin key (`admin_api_keys`): this API key is a tenant's, which sees its own jobs "
        "through the API only",
        "invalid_request_error",
        "admin_key_required",
    )


class Board:
    """What every route of the board shares: who may see it, what it reads, how it renders."""

    def __init__(self, auth: BoardAuth, reader: BoardReader):
        self.auth = auth
        self.reader = reader
        self.pages = environment()

    def html(self, template: str, request: Request, status: int = 200, **context: Any) -> HTMLResponse:
        logout = self.auth.required and COOKIE in request.cookies
        return HTMLResponse(self.pages.get_template(template).render(logout=logout, **context), status_code=status)

    async def signed_in(self, request: Request) -> None:
        if not self.auth.allows(request):
            raise self.refusal(request)

    def refusal(self, request: Request) -> APIError:
        """A tenant's key is right but not enough (403); a missing or wrong one, or no session, a 401."""
        return admin_key_required() if self.auth.is_tenant_key(bearer_key(request)) else unauthorized()

    def signed_out(self, request: Request) -> RedirectResponse:
        """A page's answer to a visitor it does not let in: the login form, or the 403 of a tenant's
        Bearer key (a script's, which a login would not mend)."""
        if self.auth.is_tenant_key(bearer_key(request)):
            raise admin_key_required()
        return to_login()

    async def from_the_board(self, request: Request) -> None:
        """An action (it changes something) must come from the board's own script: see auth.py."""
        await self.signed_in(request)
        if request.headers.get(ACTION_HEADER) != "1":
            raise APIError(403, f"board actions need the {ACTION_HEADER} header", "invalid_request_error", "forbidden")


def to_login() -> RedirectResponse:
    return RedirectResponse("/board/login", status_code=303)


def add_overview_routes(router: APIRouter, board: Board) -> None:
    """The board's page (a signed-out visitor goes to the login form) and its overview fragment."""

    @router.get("")
    async def page(request: Request):
        if not board.auth.allows(request):
            return board.signed_out(request)
        return board.html("board.jinja", request, view=await board.reader.overview(), shown=JOBS_SHOWN)

    # The page's address as people type it: the app redirects no other path (redirect_slashes is
    # off, so that an API path with a slash is OpenAI's 404), but a browser's /board/ is the board.
    @router.get("/")
    async def page_with_slash():
        return RedirectResponse("/board", status_code=307)

    @router.get("/overview", dependencies=[Depends(board.signed_in)])
    async def overview(request: Request):
        return board.html("overview.jinja", request, view=await board.reader.overview(), shown=JOBS_SHOWN)


def add_job_routes(router: APIRouter, board: Board, client: AsyncClient, keepalive_s: float) -> None:
    """A job's page, its summary fragment, its text as Server-Sent Events, and its cancel."""

    @router.get("/job")
    async def job_page(request: Request, id: str):
        if not board.auth.allows(request):
            return board.signed_out(request)
        try:
            view = await board.reader.job(id)
        except JobNotFound as e:
            raise not_found(e.message, "job_not_found") from None
        return board.html("job.jinja", request, view=view)

    @router.get("/job/summary", dependencies=[Depends(board.signed_in)])
    async def job_summary(request: Request, id: str):
        return board.html("job_summary.jinja", request, view=await board.reader.job(id))

    @router.get("/job/events", dependencies=[Depends(board.signed_in)])
    async def job_events(request: Request, id: str):
        # Checked before the stream starts: past its first byte, an error cannot be a 400.
        job_id = check_job_id(id)
        after = check_event_id(request.headers.get("last-event-id", "0-0"))
        return EventStream(text_events(client, job_id, after, keepalive_s))

    @router.post("/job/cancel", dependencies=[Depends(board.from_the_board)])
    async def cancel(id: str):
        status = await client.cancel(id)
        log.info("board: job %s cancel requested; it was %s", id, status.status)
        return Response(status.model_dump_json(), media_type="application/json")


def add_dead_letter_routes(router: APIRouter, client: AsyncClient, board: Board) -> None:
    """A dead letter's retry and purge: actions, refused with 404 or 409 (action_refused)."""

    @router.post("/dead/retry", dependencies=[Depends(board.from_the_board)])
    async def retry(queue: str, letter: str):
        try:
            retried = await client.on_queue(check_name("queue", queue)).dead_letters.retry(check_name("letter", letter))
        except (DeadLetterNotFound, NotRetryable) as e:
            raise action_refused(e) from None
        log.info(
            "board: dead letter %s of queue %r retried: job %s is entry %s",
            letter,
            queue,
            retried.job_id,
            retried.entry_id,
        )
        return Response(retried.model_dump_json(), media_type="application/json")

    @router.post("/dead/purge", dependencies=[Depends(board.from_the_board)])
    async def purge(queue: str, letter: str):
        try:
            purged = await client.on_queue(check_name("queue", queue)).dead_letters.purge(check_name("letter", letter))
        except DeadLetterNotFound as e:
            raise action_refused(e) from None
        log.info("board: dead letter %s of queue %r (job %s) purged", letter, queue, purged.job_id)
        return Response(purged.model_dump_json(), media_type="application/json")


def add_session_routes(router: APIRouter, board: Board, failures: AuthFailures) -> None:
    """The login form, a login (a session cookie for a right key) and a logout."""

    @router.get("/login")
    async def login_form(request: Request):
        return board.html("login.jinja", request)

    @router.post("/login")
    async def login(request: Request):
        # The form's one field, parsed here: FastAPI's Form() would need python-multipart. The edge
        # has bounded the body (gateway/edge.py). A right key logs in whatever its address has
        # failed; a wrong one past the limit is a 429 (gateway.api_keys.AuthFailures).
        key = parse_qs((await request.body()).decode(errors="replace")).get("key", [""])[0]
        session = board.auth.session_for(key)
        if session is None and board.auth.is_tenant_key(key):  # a right key: no failed attempt
            return board.html("login.jinja", request, status=403, tenant=True)
        if session is None:
            return login_refused(board, request, failures.failed(client_address(request)))
        return session_started(session, secure=request.url.scheme == "https")

    @router.post("/logout")
    async def logout():
        response = RedirectResponse("/board/login" if board.auth.required else "/board", status_code=303)
        response.delete_cookie(COOKIE, path="/board")
        return response


def login_refused(board: Board, request: Request, retry_after: float | None) -> Response:
    """A wrong key: the form again, 401 (its challenge as the API's: the board takes a Bearer key
    too), or 429 once its address has failed too often."""
    if retry_after is None:
        response = board.html("login.jinja", request, status=401, wrong=True)
        response.headers["WWW-Authenticate"] = WWW_AUTHENTICATE
        return response
    response = board.html("login.jinja", request, status=429, retry_after=retry_after)
    response.headers.update(retry_after_headers(retry_after))
    return response


def session_started(session: str, secure: bool) -> Response:
    """To the board, with the session's cookie."""
    response = RedirectResponse("/board", status_code=303)
    response.set_cookie(
        COOKIE, session, max_age=SESSION_S, path="/board", httponly=True, samesite="strict", secure=secure
    )
    return response


def action_refused(error: DeadLetterNotFound | NotRetryable) -> APIError:
    """A 404 quotes the letter's id as the API's 404s quote a name (openai_format.errors.echoed):
    cut, where a 5,000-character `letter` came back whole."""
    if isinstance(error, DeadLetterNotFound):
        return not_found(DeadLetterNotFound(error.queue, echoed(error.ident)).message, error.code)
    return APIError(409, error.message, "invalid_request_error", error.code)
