"""A job page's feed: the job's text as Server-Sent Events, read with one stream() for the whole
connection, and a keep-alive comment for each silence of `keepalive_s`.

The keep-alives time the silences between deltas, not the stream: a stream() given
`timeout=keepalive_s` ended every keepalive_s even while text came, and the next one, resumed
after the last event sent, read every event of the job again before the first new one
(job_stream.JobStream rebuilds its parser from the first event). A job of one-token events (a
streamed echo job: 16,000 of them) took longer to read again than keepalive_s once the machine
was busy, so every stream() ran out before it reached a new event: the page showed the first
token, then nothing, until after the job's end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import TypeVar

from gateway.cancellation import cancel_and_wait
from gateway.streaming import KEEPALIVE
from producer_client import AsyncClient, JobExpired, JobFailed, JobNotFound
from producer_client.schema import JobResult

T = TypeVar("T")


async def text_events(client: AsyncClient, job_id: str, after: str, keepalive_s: float) -> AsyncIterator[bytes]:
    """The job's text deltas as `text` events whose id is the job's event id (a reconnecting
    EventSource sends it back as Last-Event-ID), then one `end` event with the result's
    finished_at, by which the page tells a later run of the job (a retry) from this one; a
    comment whenever nothing has come for `keepalive_s`, so that proxies keep a queued job's
    stream open."""
    result: JobResult | None
    try:
        async with aclosing(with_silences(client.stream(job_id, after=after), keepalive_s)) as deltas:
            async for delta in deltas:
                if delta is None:
                    yield KEEPALIVE
                else:
                    yield f"id: {delta.event_id}\nevent: text\ndata: {json.dumps(delta.text)}\n\n".encode()
        result = (await client.status(job_id)).result
    except (JobFailed, JobExpired) as e:
        result = e.result
    except JobNotFound:
        result = None
    finished = "" if result is None or result.timings.finished_at is None else str(result.timings.finished_at)
    yield f"event: end\ndata: {json.dumps({'finished': finished})}\n\n".encode()


async def with_silences(items: AsyncIterator[T], silence_s: float) -> AsyncGenerator[T | None, None]:
    """`items`, and None for each `silence_s` in which none came. The read waited on goes on
    across a silence: cut off, it could not resume where it was."""
    reading: asyncio.Future[T] | None = None
    try:
        while True:
            if reading is None:
                reading = asyncio.ensure_future(anext(items))
            done, _ = await asyncio.wait({reading}, timeout=silence_s)
            if not done:
                yield None
                continue
            read, reading = reading, None
            try:
                item = read.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if reading is not None:  # the caller left mid-read (the page closed)
            await cancel_and_wait([reading])
        await items.aclose()  # type: ignore[attr-defined]
