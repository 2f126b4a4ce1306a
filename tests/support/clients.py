"""The producer clients a test checks with: Client, or AsyncClient behind Client's synchronous
interface, so that one test body checks both."""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

from producer_client import AsyncClient, Client
from producer_client.protocol import execution


class SyncView:
    """An AsyncClient driven on its own event loop, with Client's synchronous methods."""

    def __init__(self, client: AsyncClient, loop: asyncio.AbstractEventLoop | None = None):
        self.client = client
        self.loop = loop or asyncio.new_event_loop()

    def __getattr__(self, name):
        attr = getattr(self.client, name)
        if inspect.isasyncgenfunction(attr):
            return lambda *a, **kw: self._iterate(attr(*a, **kw))
        if inspect.iscoroutinefunction(attr):
            return lambda *a, **kw: self.loop.run_until_complete(attr(*a, **kw))
        return attr

    def _iterate(self, agen):
        while True:
            try:
                yield self.loop.run_until_complete(agen.__anext__())
            except StopAsyncIteration:
                return

    def on_queue(self, queue: str) -> SyncView:
        """The client's on_queue(), on the same event loop: its connections belong to it."""
        return SyncView(self.client.on_queue(queue), self.loop)

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


def make_client(kind: str, url: str, queue: str, **kwargs) -> Client | SyncView:
    if kind == "sync":
        return Client(url, queue, **kwargs)
    return SyncView(AsyncClient(url, queue, **kwargs))


def commands_sent(monkeypatch, redis_client: Any = None) -> list[list[str]]:
    """The command names of each round trip the clients make from now on (sync and asyncio); with
    `redis_client`, those made over that redis-py client alone (a client's `.redis`: not those of
    a worker serving in the same process)."""
    sent: list[list[str]] = []

    def recorded(client, add):
        def add_and_record(pipe):
            add(pipe)
            if redis_client is None or client is redis_client:
                sent.append([str(args[0]) for args, _ in pipe.stack])

        return add_and_record

    execute, aexecute = execution.execute, execution.aexecute
    monkeypatch.setattr(
        execution, "execute", lambda client, add, *a, **kw: execute(client, recorded(client, add), *a, **kw)
    )
    monkeypatch.setattr(
        execution, "aexecute", lambda client, add, *a, **kw: aexecute(client, recorded(client, add), *a, **kw)
    )
    return sent
