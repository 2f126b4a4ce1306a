"""uvicorn's HTTP protocol with a deadline on each request's head.

uvicorn times a connection only between two requests (its keep-alive timeout, armed once an answer
is sent): a connection that never sends a request, or sends its head a byte now and then, is held
for as long as its client keeps it open, and a few clients holding many each would take every file
descriptor the gateway has (a "slowloris"). The edge (gateway/edge.py) times the body, which the app
reads; the head is read by the protocol before the app runs, so its deadline is kept here: a
request's head must arrive whole within `header_timeout_s` of the connection's opening (its first
request) or of its first byte (a later request on the connection), else a 408 `request_timeout`
and the connection closes. A connection that sent no byte at all is closed without an answer, as
uvicorn closes an idle keep-alive one.

Nor does uvicorn bound a head's size: the parser holds a header line, and uvicorn the headers, for
as long as they come (a client sending 170 MiB of one header in 2.5 s grew the gateway by as
much). A head past MAX_HEAD_BYTES is answered 431 and its connection closed. The bytes are counted
as they are read, so the gateway holds at most the limit and one read of the socket.

Both answers, the edge's 408 for a body too slow and 413 for one too large, and any answer begun
before its request's body came whole (a 401, a 415, a 404 decided from the head: the connection
closes rather than read on a body nobody will use), are sent while the client may still be sending:
the connection's close lingers (close_lingering), so that the client reads the answer."""

from __future__ import annotations

import asyncio
import uuid
from typing import TYPE_CHECKING

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from openai_format.errors import APIError

if TYPE_CHECKING:  # uvicorn's private module, for the annotation alone
    from uvicorn._types import ASGISendEvent

# Far above any client's head (the SDKs send about 1 KiB); nginx's largest is 32 KiB by default.
MAX_HEAD_BYTES = 64 << 10
LINGER_S = 1.0


def head_timed_protocol(header_timeout_s: float) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (httptools is a dependency of the gateway's), with the head's
    deadline. A class per setting: uvicorn makes one protocol per connection from the class."""

    class HeadTimedProtocol(HttpToolsProtocol):
        head_timer: asyncio.TimerHandle | None = None
        head_begun = False
        in_head = True  # the bytes read now are a head's (a request's body is the edge's to bound)
        head_bytes = 0
        head_tail = b""  # the head's last 3 bytes read: its end, CRLF CRLF, may straddle two reads

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            self.arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self.in_head and self.head_bytes + len(data) > MAX_HEAD_BYTES and not self.head_fits(data):
                self.refuse_head()  # before the parser reads it: it may find the head whole in this read
                return
            if self.in_head:
                self.head_bytes += len(data)
                self.head_tail = (self.head_tail + data)[-3:]
            super().data_received(data)
            # Checked after the parser has read them: a read that ends the head may hold a body too.
            if self.in_head and self.head_bytes > MAX_HEAD_BYTES and not self.transport.is_closing():
                self.refuse_head()

        def head_fits(self, data: bytes) -> bool:
            """Whether the head ends within the limit in `data`, the read that passes it (the rest
            of the read is its body, or the next request's)."""
            end = (self.head_tail + data).find(b"\r\n\r\n")
            return end >= 0 and self.head_bytes - len(self.head_tail) + end + 4 <= MAX_HEAD_BYTES

        def refuse_head(self) -> None:
            """The 431: the client may still be sending its head."""
            self.disarm_head_timer()
            self.in_head = False
            self.transport.write(answer(head_too_large()))
            close_lingering(self)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.head_begun = True
            if self.head_timer is None:
                self.arm_head_timer()

        def on_headers_complete(self) -> None:
            self.disarm_head_timer()
            self.head_begun = self.in_head = False
            super().on_headers_complete()
            if self.cycle is not None and self.cycle.transport is self.transport:  # a new request's
                self.cycle.transport = LingeringTransport(self, self.cycle)  # type: ignore[assignment]
                close_if_answered_before_body(self.cycle)

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self.in_head, self.head_bytes, self.head_tail = True, 0, b""  # what follows is the next request's head

        def connection_lost(self, exc: Exception | None) -> None:
            self.disarm_head_timer()
            super().connection_lost(exc)

        def arm_head_timer(self) -> None:
            self.head_timer = self.loop.call_later(header_timeout_s, self.on_head_timeout)

        def disarm_head_timer(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def on_head_timeout(self) -> None:
            self.head_timer = None
            if self.transport.is_closing():
                return
            if self.head_begun:
                self.transport.write(answer(head_too_slow(header_timeout_s)))
            self.transport.close()

    return HeadTimedProtocol


def close_lingering(protocol: HttpToolsProtocol) -> None:
    """Close after an answer sent while the client may still be sending (a head past its limit, a
    body past its time): closing a socket with unread bytes, or one that more bytes reach, resets
    the connection, and the reset drops the answer the client has not read yet. So the answer is
    followed by an end of writing, what comes is dropped, and the connection closes LINGER_S
    later, or once its client closes its side (uvicorn's eof_received lets the transport close)."""
    protocol.data_received = lambda data: None  # type: ignore[method-assign]
    protocol.flow.resume_reading()  # paused while the app read slower, maybe: bytes are dropped only once read
    protocol.transport.write_eof()
    protocol.loop.call_later(LINGER_S, protocol.transport.close)


def close_if_answered_before_body(cycle: RequestResponseCycle) -> None:
    """Make an answer begun before its request's body came whole say `Connection: close`, and close
    its connection once sent (lingering: LingeringTransport). Such an answer was decided without the
    body (a 401, a 415, a 404, a 405): uvicorn would otherwise read on and drop the rest of the body
    to keep the connection, unbounded by the edge, which bounds only what the app reads, for as long
    as its client sends it. HTTP has a server that answers before reading the whole content either
    close or read and drop it (RFC 9110 10.1.1), the close in stages (RFC 9112 9.6: the linger);
    a request without a body, or one the app read whole, keeps its connection."""
    send = cycle.send

    async def send_closing_if_body_unread(message: ASGISendEvent) -> None:
        if message["type"] == "http.response.start" and cycle.more_body:
            cycle.keep_alive = False  # uvicorn adds the header and closes once the answer is sent
        await send(message)

    cycle.send = send_closing_if_body_unread  # type: ignore[method-assign]


class LingeringTransport:
    """A request's transport as uvicorn's request cycle sees it. The cycle closes the connection
    once an answer saying `Connection: close` is sent whole (the edge's 408 for a body too slow, its
    413 for one too large: gateway/edge.py; any answer begun before the body came whole:
    close_if_answered_before_body): if the request's body has not come whole, that close lingers."""

    def __init__(self, protocol: HttpToolsProtocol, cycle: RequestResponseCycle) -> None:
        self.protocol = protocol
        self.cycle = cycle

    def close(self) -> None:
        transport = self.protocol.transport
        if self.cycle.response_complete and self.cycle.more_body and not transport.is_closing():
            close_lingering(self.protocol)
        else:
            transport.close()

    def __getattr__(self, name: str) -> object:  # write, is_closing: the connection's own
        return getattr(self.protocol.transport, name)


def head_too_slow(header_timeout_s: float) -> APIError:
    return APIError(
        408,
        f"the request's head did not arrive whole within {header_timeout_s:g} s (header_timeout_s)",
        "invalid_request_error",
        "request_timeout",
    )


def head_too_large() -> APIError:
    return APIError(
        431, f"the request's head exceeds {MAX_HEAD_BYTES} bytes", "invalid_request_error", "headers_too_large"
    )


def answer(error: APIError) -> bytes:
    """The error's answer, written whole on the socket: no request exists for the app to answer.
    It has a request id of its own, as every answer of the gateway's (RequestContext): the client's
    is in the head not read."""
    body = error.body.model_dump_json().encode()
    reason = {408: "Request Timeout", 431: "Request Header Fields Too Large"}[error.status]
    head = (
        f"HTTP/1.1 {error.status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"x-request-id: {uuid.uuid4().hex}\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
