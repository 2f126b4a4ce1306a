"""Which queue serves which model, from the live workers' heartbeats.

Each worker's heartbeat names its model (its --model: a preset, "echo", or a checkpoint path,
served under that name as vLLM serves a path) and its queue. A model served on several queues
goes to the queue with the most live workers serving it (ties: the first by name). The
settings' `models` map pins a name to a queue on top: it routes even while that queue has no
live worker (a queue scaled to zero), and is listed while it has one.

The table is read again at most every `refresh_s` seconds, and at once when a request names a
model it does not know (a worker that just started), so routing costs no Redis round trip.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from dataclasses import dataclass

from openai_format.errors import not_found
from openai_format.responses import ModelCard
from producer_client import AsyncClient, WorkerInfo


@dataclass(frozen=True)
class RouteTable:
    queues: dict[str, str]  # model name -> queue
    cards: list[ModelCard]  # what GET /v1/models lists

    @classmethod
    def build(cls, workers: list[WorkerInfo], pinned: dict[str, str]) -> RouteTable:
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        started: dict[str, float] = {}
        for w in workers:
            counts[w.model][w.queue] += 1
            started[w.model] = min(started.get(w.model, w.started_at), w.started_at)
        queues = {model: min(by_queue, key=lambda q: (-by_queue[q], q)) for model, by_queue in counts.items()}
        queue_started: dict[str, float] = {}
        for w in workers:
            queue_started[w.queue] = min(queue_started.get(w.queue, w.started_at), w.started_at)
        for name, queue in pinned.items():
            queues[name] = queue
            if queue in queue_started:
                started[name] = queue_started[queue]
        cards = [ModelCard(id=name, created=int(at)) for name, at in sorted(started.items())]
        return cls(queues, cards)


class ModelRegistry:
    def __init__(self, client: AsyncClient, pinned: dict[str, str], refresh_s: float):
        self.client = client
        self.pinned = pinned
        self.refresh_s = refresh_s
        self.table = RouteTable.build([], pinned)
        self.fresh_until = 0.0
        self.reading: asyncio.Future | None = None  # one read at a time, shared by its waiters

    async def queue_for(self, model: str) -> str:
        """The queue of `model`, or a 404 in OpenAI's shape."""
        table = await self.current()
        if model not in table.queues:
            table = await self.current(force=True)
        if model not in table.queues:
            raise not_found(
                f"the model `{model}` does not exist (no live worker serves it)", "model_not_found", "model"
            )
        return table.queues[model]

    async def current(self, force: bool = False) -> RouteTable:
        if force or time.monotonic() >= self.fresh_until:
            if self.reading is None:
                self.reading = asyncio.ensure_future(self._read())
            # shield: a waiter that is cancelled (its client left) must not cancel the others' read.
            await asyncio.shield(self.reading)
        return self.table

    async def _read(self) -> None:
        try:
            workers = await self.client.workers()
            self.table = RouteTable.build(workers, self.pinned)
            self.fresh_until = time.monotonic() + self.refresh_s
        finally:
            self.reading = None
