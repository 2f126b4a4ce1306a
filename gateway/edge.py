"""The gateway's edge: what every request passes before the app reads a byte of its body.

- **Who.** A route that needs an API key gets it checked here, from the headers alone: an
  unauthenticated upload is refused before any of it is read, so none of it reaches memory or
  the disk (FastAPI reads and spools a multipart body before a route's dependencies run). The
  key's tenant goes into the request's state. An address that has got a key or a login wrong
  `auth_failures_per_minute` times has its further wrong keys answered 429 until its minute is
  over; a right key is served whatever its address has failed (gateway.api_keys.AuthFailures).
- **How much.** Each route has a body limit: `max_json_bytes` for the JSON API, the batch file
  limit (plus room for the form around it) for uploads, a small one for the board's login form.
  A `Content-Length` over it is refused at once with 413; a body sent without one (chunked) is
  counted as it is read and cut off with 413 once it passes the limit. Either 413 closes its
  connection: the rest of that body is never read.
- **How long.** The whole body must arrive within `body_timeout_s` of the request's headers, else
  408: the server under us (uvicorn) waits for a body as long as its client keeps the connection
  open, so a client sending a byte now and then would hold a connection, and what the app had
  read, for ever; enough of them hold them all.
- **What.** A JSON route's body must say `Content-Type: application/json` (or `+json`): a page of
  another site can send a "simple" cross-site request (text/plain, a form, no type at all)
  without a CORS preflight, and must not enqueue work through a browser that can reach the
  gateway. 415 otherwise, as FastAPI answers for its own JSON bodies since CVE-2021-32677.
- **From where.** A browser's request that may change something (not GET, HEAD, OPTIONS) from a
  page of another origin (Sec-Fetch-Site; without it, an Origin of another host than the Host
  header) is refused 403 unless `cors_origins` grants that origin: a form's multipart upload needs
  no preflight (is_cross_site_action).
- **Where to.** An open gateway (no `api_keys`) answers a request only if its Host is an address,
  `localhost`, a name under `.localhost`, or one of `allowed_hosts` (producer_client.hosts: DNS
  rebinding; a worker's metrics answer by the same rule). A keyed gateway answers any Host: a
  rebound page has no key, nor the board's cookie, which the browser keeps per host.
"""

from __future__ import annotations

import asyncio
import email.message
import time
import urllib.parse
from dataclasses import dataclass

from starlette.requests import HTTPConnection
from starlette.responses import Response

from gateway.api_keys import Access, AuthFailures, bearer_key
from gateway.errors import RetryLater, headers_of, unauthorized
from openai_format.errors import APIError
from producer_client.hosts import ONE_HOST_LINE, Hosts, names_one_host

# The form around a batch file (its boundary, headers and the purpose field) is far smaller.
MULTIPART_OVERHEAD_BYTES = 64 << 10
BOARD_BODY_BYTES = 4 << 10  # the login form's one key, with room to spare


@dataclass(frozen=True)
class Policy:
    limit: int  # body bytes at most
    needs_key: bool
    json: bool  # a body, if any, must be JSON


@dataclass(frozen=True)
class Limits:
    json_bytes: int
    upload_bytes: int
    monitoring_needs_key: bool
    body_timeout_s: float

    def policy(self, method: str, path: str, keys_required: bool) -> Policy:
        if path == "/v1/files" and method == "POST":
            return Policy(self.upload_bytes + MULTIPART_OVERHEAD_BYTES, keys_required, json=False)
        if path.startswith("/v1/") or path == "/generate":
            return Policy(self.json_bytes, keys_required, json=True)
        if path in ("/health", "/metrics"):
            return Policy(self.json_bytes, keys_required and self.monitoring_needs_key, json=False)
        if path == "/board" or path.startswith("/board/"):
            return Policy(BOARD_BODY_BYTES, needs_key=False, json=False)  # the board checks its own
        return Policy(self.json_bytes, needs_key=False, json=False)


class BodyTooLarge(Exception):
    """Raised into the app's read of a body that passed its limit."""


class BodyTimedOut(Exception):
    """Raised into the app's read of a body that did not arrive whole in time."""


class CountedBody:
    """The request's `receive`, counting body bytes and timing the body: past `limit` it raises
    BodyTooLarge; a body not whole by `deadline` (monotonic) raises BodyTimedOut. Once the body is
    whole, receive() passes through untimed: the app then waits on it for the client's disconnect
    (a stream's cancel), for as long as it answers."""

    def __init__(self, receive, limit: int, deadline: float):
        self.receive = receive
        self.limit = limit
        self.deadline = deadline
        self.seen = 0
        self.whole = False
        self.timed_out = False

    @property
    def exceeded(self) -> bool:
        return self.seen > self.limit

    @property
    def cut(self) -> bool:
        return self.exceeded or self.timed_out

    async def __call__(self) -> dict:
        message = await (self.receive() if self.whole else self._receive_in_time())
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            self.whole = not message.get("more_body", False)
            if self.exceeded:
                raise BodyTooLarge()
        return message

    async def _receive_in_time(self) -> dict:
        try:
            return await asyncio.wait_for(self.receive(), max(0.0, self.deadline - time.monotonic()))
        except TimeoutError:
            self.timed_out = True
            raise BodyTimedOut() from None


class Edge:
    """ASGI middleware in front of the routes (see the module's docstring)."""

    def __init__(
        self, app, access: Access, limits: Limits, failures: AuthFailures, hosts: Hosts, origins: frozenset[str]
    ):
        self.app = app
        self.access = access
        self.limits = limits
        self.failures = failures
        self.hosts = hosts
        self.origins = origins  # cors_origins: the pages of other sites that may act here

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = HTTPConnection(scope)
        if not host_lines_named_once(scope):
            return await refusal_response(HOST_MISSING_OR_REPEATED)(scope, receive, send)
        if not self.hosts.allows(request.headers.get("host")):
            return await refusal_response(HOST_NOT_ALLOWED)(scope, receive, send)
        if is_cross_site_action(request, self.origins):
            return await refusal_response(CROSS_SITE_ACTION)(scope, receive, send)
        policy = self.limits.policy(scope["method"], scope["path"], self.access.required)
        refusal = self.refusal(request, policy)
        if refusal is not None:
            return await refusal_response(refusal)(scope, receive, send)
        body = CountedBody(receive, policy.limit, time.monotonic() + self.limits.body_timeout_s)
        await self.run(scope, body, send)

    def refusal(self, request: HTTPConnection, policy: Policy) -> APIError | None:
        """Why the request is refused from its headers alone, if it is. A right key is never
        refused for its address's failures (gateway.api_keys.AuthFailures)."""
        given = bearer_key(request)
        tenant = self.access.tenant(given) if given is not None or not self.access.required else None
        if given is not None and tenant is None:
            retry_after = self.failures.failed(client_address(request))
            if retry_after is not None:
                return too_many_failures(retry_after)
        if policy.needs_key and tenant is None:
            return unauthorized()
        request.scope.setdefault("state", {})["tenant"] = tenant
        return self.body_refusal(request, policy)

    @staticmethod
    def body_refusal(request: HTTPConnection, policy: Policy) -> APIError | None:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > policy.limit):
            return too_large(policy.limit)
        has_body = (length is not None and int(length) > 0) or "transfer-encoding" in request.headers
        if policy.json and has_body and not is_json(request.headers.get("content-type")):
            return APIError(
                415,
                "the body must be JSON, sent with Content-Type: application/json",
                "invalid_request_error",
                "unsupported_media_type",
            )
        return None

    async def run(self, scope, body: CountedBody, send) -> None:
        """The app, with a 413 or a 408 in place of whatever it answers once the body passed its
        limit or its time (its parsers may turn the exception they meet into an error of their own).
        Either closes the connection: the rest of the body may still come (the close lingers, so
        that a client still sending reads the answer: gateway/http_protocol.py)."""
        started = False

        async def send_unless_cut(message) -> None:
            nonlocal started
            if body.cut:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, body, send_unless_cut)
        except Exception:
            if not body.cut or started:
                raise
        if body.cut and not started:
            await cut_response(body, self.limits.body_timeout_s)(scope, body.receive, send)


def client_address(request: HTTPConnection) -> str:
    """The client's address: the peer's, or a trusted proxy's X-Forwarded-For (see create_app)."""
    return request.client.host if request.client is not None else "unknown"


def is_cross_site_action(request: HTTPConnection, origins: frozenset[str]) -> bool:
    """A browser's request that may change something (not GET, HEAD, OPTIONS) sent by a page of
    another origin that cors_origins does not grant. A form's multipart POST needs no CORS
    preflight: a page of any site could upload batch files, as much as the file limit allows each
    time, through the browser of anyone who reaches an open gateway. Go's net/http
    CrossOriginProtection answers the same, from Sec-Fetch-Site where the browser sends it (which
    no page can set; "same-site" is another origin too: a page of another port of localhost), else
    from an Origin whose host is not the Host header's (sent_from_elsewhere). SDKs and curl send
    neither."""
    if request.scope["method"] in ("GET", "HEAD", "OPTIONS"):
        return False
    site = request.headers.get("sec-fetch-site")
    if site in ("same-origin", "none") or (site is None and not sent_from_elsewhere(request)):
        return False
    return "*" not in origins and request.headers.get("origin") not in origins


def sent_from_elsewhere(request: HTTPConnection) -> bool:
    """Whether a request without Sec-Fetch-Site (a browser older than it: Safari before 16.4) names
    an Origin of another host than it asks for. No Origin: no browser's cross-origin request (a
    browser sends Origin with every cross-origin POST); `null` (a sandboxed frame, a file) names no
    host, so it is another's."""
    origin = request.headers.get("origin")
    return origin is not None and urllib.parse.urlsplit(origin).netloc != request.headers.get("host")


def is_json(content_type: str | None) -> bool:
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


# The refused name is not repeated: the header is the client's to fill.
HOST_MISSING_OR_REPEATED = APIError(
    400,
    ONE_HOST_LINE,
    "invalid_request_error",
    "invalid_host",
)
CROSS_SITE_ACTION = APIError(
    403,
    "a page of another site may not act here (Sec-Fetch-Site, or an Origin of another host than the Host header): "
    "name its origin in cors_origins to let it",
    "invalid_request_error",
    "cross_site_request",
)
HOST_NOT_ALLOWED = APIError(
    400,
    "this open gateway (no api_keys) answers a Host header naming an address, localhost or one of "
    "allowed_hosts only (MILI_ALLOWED_HOSTS, a JSON list): name this host there, or give the gateway keys",
    "invalid_request_error",
    "host_not_allowed",
)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", "invalid_request_error", "request_too_large")


def refusal_response(error: APIError) -> Response:
    """The answer to a request refused from its headers. A 413's body, whatever its size, is not to
    be read: its connection closes. So does any other's whose body has not come whole when it is
    answered (gateway/http_protocol.py's close_if_answered_before_body); a bodiless one's stays open."""
    return closing(error_response(error)) if error.status == 413 else error_response(error)


def cut_response(body: CountedBody, timeout_s: float) -> Response:
    """The 413 or 408 of a body cut off: its connection closes."""
    return closing(error_response(too_large(body.limit) if body.exceeded else too_slow(timeout_s)))


def closing(response: Response) -> Response:
    """`response`, closing its connection once sent: uvicorn would otherwise read on the rest of a
    body the gateway refused, for as long as its client sends it. The close lingers while the body is
    unread (gateway/http_protocol.py's LingeringTransport), so that a client still sending reads the
    answer."""
    response.headers["Connection"] = "close"
    return response


def too_slow(timeout_s: float) -> APIError:
    return APIError(
        408,
        f"the request body did not arrive whole within {timeout_s:g} s (body_timeout_s)",
        "invalid_request_error",
        "request_timeout",
    )


def too_many_failures(retry_after_s: float) -> APIError:
    return RetryLater(
        429,
        "too many wrong API keys from this address: until Retry-After each further wrong one is refused"
        " (a right key is served)",
        "rate_limit_error",
        "too_many_auth_failures",
        retry_after_s,
    )


def error_response(error: APIError) -> Response:
    return Response(
        error.body.model_dump_json(), status_code=error.status, headers=headers_of(error), media_type="application/json"
    )


def host_lines_named_once(scope) -> bool:
    """The request has one Host line, or is HTTP/1.0 with none (producer_client.hosts.names_one_host)."""
    hosts = sum(1 for name, _ in scope["headers"] if name == b"host")
    return names_one_host(hosts, scope.get("http_version", ""))
