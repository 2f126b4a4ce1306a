"""Which queue serves which model, from the live workers' heartbeats.

Each worker's heartbeat names its model (its --model: a preset, "echo", or a checkpoint path,
served under that name as vLLM serves a path) and its queue. A model served on several queues
goes to the queue with the most live workers serving it (ties: the first by name). The
settings' `models` map pins a name to a queue on top: it routes even while that queue has no
live worker (a queue scaled to zero), so it is listed and retrieved then too, as OpenAI lists the
models a request may name (its `created`: its queue's first live worker's start, else the
gateway's). /health counts only the names live workers serve.

A worker's heartbeat also names the LoRA adapters it serves. As in vLLM, a request's `model` may
name one: it goes to the queue of the workers that serve it (the most, as for a model), as a job
on that adapter, and /v1/models lists it with its base model as `parent`. A base model's name
wins over an adapter's of the same name.

The table is read again at most every `refresh_s` seconds, and at once when a request names a
model it does not know (a worker that just started), so routing costs no Redis round trip.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from openai_format.errors import echoed, not_found
from openai_format.responses import ModelCard
from producer_client import AsyncClient, WorkerInfo


@dataclass(frozen=True)
class Route:
    queue: str
    adapter: str | None = None  # the LoRA adapter the request's model names; None: a base model


@dataclass(frozen=True)
class RouteTable:
    queues: dict[str, str]  # model name (or adapter name) -> queue
    cards: list[ModelCard]  # what GET /v1/models lists
    adapters: dict[str, str] = field(default_factory=dict)  # adapter name -> its base model
    live: frozenset[str] = frozenset()  # the names of `cards` a live worker serves

    @property
    def live_cards(self) -> list[ModelCard]:
        return [card for card in self.cards if card.id in self.live]

    @classmethod
    def build(cls, workers: list[WorkerInfo], pinned: dict[str, str], pinned_since: float) -> RouteTable:
        counts: dict[str, Counter[str]] = defaultdict(Counter)
        started: dict[str, float] = {}
        for w in workers:
            counts[w.model][w.queue] += 1
            started[w.model] = min(started.get(w.model, w.started_at), w.started_at)
        queues = {model: most_served(by_queue) for model, by_queue in counts.items()}
        adapters = adapter_routes(workers, set(queues) | set(pinned), queues, started)
        queue_started: dict[str, float] = {}
        for w in workers:
            queue_started[w.queue] = min(queue_started.get(w.queue, w.started_at), w.started_at)
        live = set(started)
        for name, queue in pinned.items():
            queues[name] = queue
            if queue in queue_started:
                started[name] = queue_started[queue]
                live.add(name)
            else:
                started.setdefault(name, pinned_since)
        cards = [ModelCard(id=name, created=int(at), parent=adapters.get(name)) for name, at in sorted(started.items())]
        return cls(queues, cards, adapters, frozenset(live))

    def route(self, model: str) -> Route | None:
        queue = self.queues.get(model)
        return None if queue is None else Route(queue, model if model in self.adapters else None)


def most_served(by_queue: Counter[str]) -> str:
    """The queue with the most live workers serving a name (ties: the first by name)."""
    return min(by_queue, key=lambda q: (-by_queue[q], q))


def adapter_routes(
    workers: list[WorkerInfo], models: set[str], queues: dict[str, str], started: dict[str, float]
) -> dict[str, str]:
    """Adds each adapter (not named as a model) to `queues` and `started`; returns its base model:
    that of the workers of the queue it goes to."""
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for w in workers:
        for name in w.adapters:
            if name not in models:
                counts[name][w.queue] += 1
                started[name] = min(started.get(name, w.started_at), w.started_at)
    parents = {}
    for name, by_queue in counts.items():
        queues[name] = most_served(by_queue)
        parents[name] = next(w.model for w in workers if w.queue == queues[name] and name in w.adapters)
    return parents


class ModelRegistry:
    def __init__(self, client: AsyncClient, pinned: dict[str, str], refresh_s: float):
        self.client = client
        self.pinned = pinned
        self.refresh_s = refresh_s
        self.pinned_since = time.time()  # a pinned name's `created` while no live worker serves it
        self.table = RouteTable.build([], pinned, self.pinned_since)
        self.fresh_until = 0.0
        self.reading: asyncio.Future | None = None  # one read at a time, shared by its waiters

    async def queue_for(self, model: str) -> str:
        """The queue of `model` (a model or an adapter), or a 404 in OpenAI's shape."""
        return (await self.route(model)).queue

    async def route(self, model: str) -> Route:
        """Where a request naming `model` goes, and whether that is an adapter; a 404 in OpenAI's
        shape for a name neither pinned nor served by a live worker."""
        route = (await self.current()).route(model)
        if route is None:
            route = (await self.current(force=True)).route(model)
        if route is None:
            raise not_found(
                f"the model `{echoed(model)}` does not exist (no live worker serves it)", "model_not_found", "model"
            )
        return route

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
            self.table = RouteTable.build(workers, self.pinned, self.pinned_since)
            self.fresh_until = time.monotonic() + self.refresh_s
        finally:
            self.reading = None
