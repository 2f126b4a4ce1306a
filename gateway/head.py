"""HEAD answered as GET, without the body (RFC 9110 9.3.2: a server that answers GET answers HEAD
the same way, its head alone). Probes and uptime checkers send HEAD, and FastAPI's routes, unlike
Starlette's own, match it on no GET route: every one answered 405."""

from __future__ import annotations

import anyio

END_OF_BODY = {"type": "http.response.body", "body": b"", "more_body": False}


class HeadAsGet:
    """ASGI middleware, just around the routes: a HEAD request reaches them as a GET (whatever
    route may be added), behind the same edge (key, Host: gateway/edge.py), and its answer ends
    with its head. The scope says HEAD again from the head on, which the server (uvicorn) reads
    to send no body, and the request's log line and metrics read after; the app is stopped there,
    so that a streamed answer (a board job's events) does not run on unread, holding the
    connection the client takes to be free once the head has come."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            return await self.app(scope, receive, send)
        with anyio.CancelScope() as answer:

            async def head_only(message) -> None:
                scope["method"] = "HEAD"
                if message["type"] == "http.response.start":
                    return await send(message)
                await send(END_OF_BODY)
                answer.cancel()

            scope["method"] = "GET"
            try:
                await self.app(scope, receive, head_only)
            finally:
                scope["method"] = "HEAD"
