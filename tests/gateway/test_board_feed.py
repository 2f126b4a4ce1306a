"""The board's job feed (gateway/board/feed.py) without a process: its keep-alives time the silences
between a stream's items, and leave the read waited on going on (tests/board follows a job's feed
over HTTP; its browser tests hold an event loop that an async test there could not run beside)."""

from __future__ import annotations

import asyncio

from gateway.board.feed import with_silences


async def test_a_silence_leaves_the_read_going_on_and_a_close_mid_read_closes_the_source():
    released, seen = asyncio.Event(), []

    async def source():
        try:
            yield "first"
            await released.wait()  # a read that outlasts several silences
            yield "second"
            await asyncio.Event().wait()
        finally:
            seen.append("closed")

    items = with_silences(source(), 0.01)
    seen += [await anext(items), await anext(items), await anext(items)]
    released.set()
    while (item := await anext(items)) is None:  # a silence more, on a busy machine
        pass
    seen.append(item)
    assert await anext(items) is None  # mid-read again
    await items.aclose()
    assert seen == ["first", None, None, "second", "closed"]
