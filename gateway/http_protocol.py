"""uvicorn's HTTP protocol with a deadline on each request's head.

uvicorn times a connection only between two requests (its keep-alive timeout, armed once an answer
is sent): a connection that never sends a request, or sends its head a byte now and then, is held
for as long as its client keeps it open, and a few clients holding many each would take every file
descriptor the gateway has (a "slowloris"). The edge (gateway/edge.py) times the body, which the app
reads; the head is read by the protocol before the app runs, so its deadline is kept here: a
request's head must arrive whole within `header_timeout_s` of the connection's opening (its first
request) or of its first byte (a later request on the connection), else a 408 `request_timeout`
and the connection closes. A connection that sent no byte at all is closed without an answer, as
uvicorn closes an idle keep-alive one."""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from openai_format.errors import APIError


def head_timed_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (httptools is a dependency of the gateway's), with the head's
    deadline. A class per setting: uvicorn makes one protocol per connection from the class."""

    class HeadTimedProtocol(HttpToolsProtocol):
        head_timer: asyncio.TimerHandle | None = None
        head_begun = False

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self.arm_head_timer()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.head_begun = True
            if self.head_timer is None:
                self.arm_head_timer()

        def on_headers_complete(self) -> None:
            self.disarm_head_timer()
            self.head_begun = False
            super().on_headers_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm_head_timer()
            super().connection_lost(exc)

        def arm_head_timer(self) -> None:
            self.head_timer = self.loop.call_later(header_timeout_s, self.head_too_slow)

        def disarm_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def head_too_slow(self) -> None:
            self.head_timer = None
            if self.transport.is_closing():
                return
            if self.head_begun:
                self.transport.write(head_timeout_answer(header_timeout_s))
            self.transport.close()

    return HeadTimedProtocol


def head_timeout_answer(header_timeout_s: float) -> bytes:
    """The 408, written whole on the socket: no request exists for the app to answer."""
    error = APIError(
        408,
        f"the request's head did not arrive whole within {header_timeout_s:g} s (header_timeout_s)",
        "invalid_request_error",
        "request_timeout",
    )
    body = error.body.model_dump_json().encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
