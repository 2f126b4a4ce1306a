"""The gateway's stop, as the open requests see it. A stopping gateway (SIGTERM: a restart or a
scale-down) ends every open request at once with a retryable error and cancels no job, so that
a client's retry, on this gateway's successor or on any other, finds its jobs still running."""

from __future__ import annotations

import asyncio


class Lifecycle:
    STOP = object()  # put on every open request's inbox when the gateway begins to stop

    def __init__(self):
        self.stopping = asyncio.Event()
        self.inboxes: set[asyncio.Queue] = set()
        self.loop: asyncio.AbstractEventLoop | None = None

    def started(self) -> None:
        self.loop = asyncio.get_running_loop()

    def stop_from_signal(self) -> None:
        """From a signal handler: the stop runs on the event loop's own thread."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.begin_stop)

    def begin_stop(self) -> None:
        self.stopping.set()
        for queue in self.inboxes:
            queue.put_nowait(self.STOP)
