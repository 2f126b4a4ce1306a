"""A request's jobs as Server-Sent Events: `data: {chunk}` lines, `data: [DONE]` at the end, and a
`: keep-alive` comment whenever no token has come for `keepalive_s`, so that proxies do not cut
a stream that waits in the queue. An error after the stream began is sent as `data: {"error":
...}` (the OpenAI SDKs raise it), followed by `[DONE]`.

The stream begins (its 200 and headers) once every job has said something, its first tokens or
its end, or `stream_hold_s` has passed: only the worker tokenizes, so only then is a prompt
known to fit the context, and one that does not is a 400 as OpenAI answers it, not an error
event after a 200."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from starlette.responses import StreamingResponse

from gateway.errors import api_error_of, gateway_stopping
from gateway.jobs import Inbox, JobEvent
from gateway.lifecycle import Lifecycle
from gateway.metrics import GatewayMetrics
from openai_format.errors import APIError
from openai_format.render import ChatRenderer, CompletionRenderer
from producer_client import JobResult, TokenDelta

log = logging.getLogger("gateway.streaming")

# A proxy must pass each event on as it comes, and keep none: nginx (and the ingress controllers
# built on it) buffers an upstream's answer, a stream's tokens included, unless the answer says
# X-Accel-Buffering: no; a cache may store what does not say no-cache.
STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
KEEPALIVE = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"


def data(chunk) -> bytes:
    return b"data: " + chunk.model_dump_json().encode() + b"\n\n"


class EventStream(StreamingResponse):
    """A StreamingResponse that closes its generator when the response ends however it ends.
    Starlette cancels the sending task when the client disconnects, which may leave the
    generator suspended at a `yield`; closing it runs its cleanup (cancelling the jobs) now
    rather than whenever it is garbage-collected."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes]):
        super().__init__(content, headers=STREAM_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def opening(inbox: Inbox, hold_s: float) -> list[JobEvent]:
    """The inbox's events until every job has had one, or `hold_s` passed: what the stream starts
    with. A job's error (or the gateway stopping) is raised here, before any byte is sent, and the
    request's other jobs are released."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + hold_s
    first: list[JobEvent] = []
    heard: set[int] = set()
    try:
        while len(heard) < len(inbox.jobs.ids) and (left := deadline - loop.time()) > 0:
            item = await inbox.next(left)
            if item is None:
                break
            if item is Lifecycle.STOP:
                raise gateway_stopping()
            if isinstance(item.item, Exception):
                raise item.item
            first.append(item)
            heard.add(item.index)
    except BaseException:
        inbox.close(client_left=False)
        raise
    return first


async def events(
    inbox: Inbox,
    first: list[JobEvent],
    renderer: ChatRenderer | CompletionRenderer,
    keepalive_s: float,
    metrics: GatewayMetrics,
    retry_after_s: int,
) -> AsyncIterator[bytes]:
    """The SSE body, from the `first` events on. Leaving before the end (the client
    disconnected) releases the jobs."""
    metrics.open_streams.inc()
    ended = False
    try:
        async for chunk in chunks(inbox, first, renderer, keepalive_s, retry_after_s):
            yield chunk
        ended = True
    finally:
        metrics.open_streams.dec()
        inbox.close(client_left=not ended)


async def chunks(
    inbox: Inbox,
    first: list[JobEvent],
    renderer: ChatRenderer | CompletionRenderer,
    keepalive_s: float,
    retry_after_s: int,
) -> AsyncIterator[bytes]:
    results: list[JobResult | None] = [None] * len(inbox.jobs.ids)
    begun: set[int] = set()
    waiting = list(first)
    while len(inbox.jobs.finished) < len(results):
        item = waiting.pop(0) if waiting else await inbox.next(keepalive_s)
        if item is None:
            yield KEEPALIVE
            continue
        try:
            if item is Lifecycle.STOP:
                raise gateway_stopping()
            for chunk in job_chunks(item, renderer, begun, results):
                yield chunk
            if isinstance(item.item, JobResult):
                inbox.got_result(item)
        except Exception as e:
            yield error_event(e, inbox.jobs.request_id, retry_after_s)
            yield DONE
            return
    if renderer.include_usage:
        yield data(renderer.usage_chunk(results))
    yield DONE


def job_chunks(event: JobEvent, renderer, begun: set[int], results: list) -> list[bytes]:
    """The chunks of one job event; raises a job's error."""
    if isinstance(event.item, Exception):
        raise event.item
    out = []
    if event.index not in begun:
        begun.add(event.index)
        first = renderer.first(event.index)
        if first is not None:
            out.append(data(first))
    if isinstance(event.item, TokenDelta):
        out += [data(chunk) for chunk in renderer.delta(event.index, event.item)]
    else:
        results[event.index] = event.item
        out.append(data(renderer.end(event.index, event.item)))
    return out


def error_event(error: Exception, request_id: str, retry_after_s: int) -> bytes:
    api_error = error if isinstance(error, APIError) else api_error_of(error, retry_after_s)
    if api_error is None:
        log.exception("request %s: stream failed", request_id, exc_info=error)
        api_error = APIError(500, "internal error", "server_error")
    else:
        log.info("request %s: stream ends with %d %s", request_id, api_error.status, api_error.body.error.message)
    return data(api_error.body)
