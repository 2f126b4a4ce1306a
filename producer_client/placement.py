"""Cache-aware placement, the producers' side (docs/architecture.md): which stream a job goes to.

Stateless: a job's prompt gives a prefix key (the root of the prompt that later turns repeat), the
queue's live workers are ordered by rendezvous hashing of that key, and the job goes to the first
worker in that order whose load stays within a bound of the mean (consistent hashing with bounded
loads, Mirrokni, Thorup and Zadimoghaddam, 2018). Every producer computes the same order from the
same heartbeats, so producers that share no memory agree; the view of the workers is read at most
every REFRESH_S, and what this producer placed since is counted in. A job no worker can take
within the bound goes to the shared stream, as before placement. No I/O here: the clients run
`view_steps` over their own connections.

A job on a LoRA adapter is keyed by its adapter: the adapter's jobs go to one worker, which then
holds the adapter and the prefixes of its conversations (each adapter's prefix cache is its own),
and a hot adapter spills to the next worker in its order under the same bound. The view also says
which adapters the queue's live workers serve, so that a producer refuses a job naming another
(UnknownAdapter) before it enqueues anything."""

from __future__ import annotations

import hashlib
import math
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

from producer_client import roots
from producer_client.errors import InvalidArgument, UnknownAdapter
from producer_client.keys import Keys
from producer_client.protocol import registry
from producer_client.schema import JobRequest
from producer_client.steps import Steps

# A worker takes a job while its load is under LOAD_BOUND x the mean load (this job included):
# the paper's 1 + epsilon. Lower spreads a hot prefix sooner; higher keeps it on fewer workers.
LOAD_BOUND = 1.25
# ... or within BALANCE_ABS jobs of the least loaded worker (SGLang's cache-aware router calls the
# load imbalanced only past its balance_abs_threshold, 32 by default): at low load a batch of a few
# more jobs costs an engine step little, a prefix computed again costs its whole prefill; and the
# view's counts of what this producer placed only grow until it is read again, so a bound of the
# mean alone would spill keys at random between reads.
BALANCE_ABS = 32
REFRESH_S = 0.5  # how stale the view of the workers may be


class Placed(str, Enum):
    """Where a job went: a worker's own stream, or the shared one."""

    AFFINITY = "affinity"
    SHARED = "shared"


def prefix_key(request: JobRequest) -> bytes:
    """A digest of the job's root (roots.py): the part of its prompt that every turn of its
    conversation repeats; for a job on a LoRA adapter, of the adapter (the module's docstring)."""
    fields = request.__dict__  # not attributes: see schema.py's note on fields read from `__dict__`
    adapter, messages, prompt, input_ids = fields["adapter"], fields["messages"], fields["prompt"], fields["input_ids"]
    if adapter is not None:
        return hashlib.blake2b(b"adapter:" + adapter.encode(), digest_size=16).digest()
    if messages is not None:
        root = roots.chat_root(messages, fields["tools"]).encode()
    elif prompt is not None:
        return prompt_prefix_key(prompt)
    elif input_ids is not None:
        # The ids' machine bytes, not their decimal text: a third of the time, on a root of Qwen3's
        # chat format that may hold a whole system prompt.
        root = array("q", roots.ids_root(input_ids)).tobytes()
    else:  # JobRequest's validation refuses this; a request built past it (model_construct) too
        raise InvalidArgument("prompt", "give exactly one of prompt, messages or input_ids")
    return hashlib.blake2b(root, digest_size=16).digest()


def prompt_prefix_key(prompt: str) -> bytes:
    """prefix_key of a prompt's job without an adapter."""
    return hashlib.blake2b(roots.text_root(prompt).encode(), digest_size=16).digest()


def rendezvous_score(key: bytes, worker: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + worker.encode(), digest_size=8).digest(), "big")


@dataclass
class Candidate:
    """A live worker that takes placed jobs: its slots, and its load (the jobs it runs, those
    waiting in its stream, and those this producer placed on it since the view was read)."""

    name: str
    slots: int
    load: int


@dataclass
class View:
    read_at: float
    candidates: list[Candidate] = field(default_factory=list)
    adapters: frozenset[str] | None = None  # served by the queue's live workers; None: no worker is live

    def choose(self, key: bytes) -> Candidate | None:
        """The first worker in the key's rendezvous order under the load bound with a free slot;
        None (the lanes) with fewer than two workers or none such. The bound: LOAD_BOUND x the mean
        load, or the least load plus BALANCE_ABS, whichever is higher. A job never waits in a
        worker's stream for a slot: a stream of its own is FIFO, where lanes and tenants' shares
        would not hold, so under contention every job goes through the lanes, where they do."""
        if len(self.candidates) < 2 or all(c.load >= c.slots for c in self.candidates):
            return None  # before ordering the workers by the key: a bulk submit fills every slot soon
        total = sum(c.load for c in self.candidates) + 1
        least = min(c.load for c in self.candidates)
        bound = max(math.ceil(LOAD_BOUND * total / len(self.candidates)), least + BALANCE_ABS)
        order = sorted(self.candidates, key=lambda c: rendezvous_score(key, c.name), reverse=True)
        return next((c for c in order if c.load < bound and c.load < c.slots), None)


def candidates_from(heartbeats: Iterable[dict[str, str]], lengths: Iterable[int | None], queue: str) -> list[Candidate]:
    """The serving workers of `queue` that advertise placement and read lanes (a placed entry
    carries its lane, tenant and cost, which only those read), from their heartbeat hashes (empty:
    expired) and the lengths of their own streams (None: of another type)."""
    found = []
    for beat, length in zip(heartbeats, lengths):
        if length is None:
            continue  # its stream is of another type: a placed XADD fails until its READ makes it anew
        if beat.get("queue") != queue or beat.get("state") != "serving" or beat.get("placement") != "1":
            continue
        if beat.get("lanes") != "1":
            continue
        try:
            running, slots, held = int(beat["running"]), int(beat["slots"]), int(beat["placed_held"])
        except (KeyError, ValueError):
            continue  # a heartbeat this client cannot read places nothing
        found.append(Candidate(beat["name"], max(1, slots), running + max(0, length - held)))
    return found


def read_view(keys: Keys, queue: str) -> Steps[View]:
    """The queue's worker index, then each worker's heartbeat and own stream's length: two round
    trips (on a cluster, each to every node concerned at once)."""
    (names,) = yield from registry.worker_names(keys, [queue])
    read = yield from registry.heartbeats_and_own_depths(keys, queue, names)
    heartbeats, depths = [beat for beat, _ in read], [depth for _, depth in read]
    return View(time.monotonic(), candidates_from(heartbeats, depths, queue), served_adapters(heartbeats, queue))


def served_adapters(heartbeats: Iterable[dict[str, str]], queue: str) -> frozenset[str] | None:
    """The adapters any serving worker of `queue` serves (its heartbeat's `adapters`, comma-separated);
    None when no worker of the queue is live, and nothing can be known."""
    live = [beat for beat in heartbeats if beat.get("queue") == queue and beat.get("state") == "serving"]
    if not live:
        return None
    return frozenset(name for beat in live for name in beat.get("adapters", "").split(",") if name)


class Placement:
    """One client's placement: its view of each queue's workers, and how many jobs it placed each
    way (the gateway exports them). `enabled` False sends every job to the shared stream;
    `refresh_s` is how stale the view may get."""

    def __init__(self, enabled: bool = True, refresh_s: float = REFRESH_S):
        self.enabled = enabled
        self.refresh_s = refresh_s
        self.views: dict[str, View] = {}
        self.placed = {outcome: 0 for outcome in Placed}

    def check_adapters(self, keys: Keys, queue: str, adapters: Iterable[str | None]) -> Steps[None]:
        """UnknownAdapter for an adapter no live worker of the queue serves. With no live worker the
        producer cannot know: the job goes in, and a worker that does not serve it fails it. Reads
        the view (placement on or off) only for jobs that name an adapter."""
        wanted = sorted({name for name in adapters if name is not None})
        if not wanted:
            return
        served = (yield from self._view(keys, queue)).adapters
        unknown = [name for name in wanted if served is not None and name not in served]
        if unknown:
            raise UnknownAdapter(unknown[0], f"by the live workers of queue {queue!r}")

    def streams_for(self, keys: Keys, queue: str, prefixes: list[bytes]) -> Steps[list[str | None]]:
        """The worker stream key of each job (by its prefix_key), or None for the shared stream;
        reads the view first when it is stale."""
        if self.shared_now(queue, len(prefixes)):
            return [None] * len(prefixes)
        view = yield from self._view(keys, queue)  # placement is on: a stale view, or one to choose from
        if len(view.candidates) < 2:  # read again, nothing to choose from, for the whole batch
            self.placed[Placed.SHARED] += len(prefixes)
            return [None] * len(prefixes)
        return [self._place(view, prefix, keys, queue) for prefix in prefixes]

    def shared_now(self, queue: str, jobs: int) -> bool:
        """Whether `jobs` jobs go to the shared stream, counted so, with no view to read: placement
        off, or a fresh view with fewer than two workers. streams_for's first question; asked alone,
        without its generators, by a submit to a queue of one worker or none (bench/RESULTS.md, y/submit3)."""
        if self.enabled:
            view = self._fresh_view(queue)
            if view is None or len(view.candidates) >= 2:
                return False
        self.placed[Placed.SHARED] += jobs
        return True

    def forget_view(self, queue: str) -> None:
        """Read `queue`'s view again before the next placement: it chose a worker whose stream
        turned out to be of another type."""
        self.views.pop(queue, None)

    def _view(self, keys: Keys, queue: str) -> Steps[View]:
        """The queue's view, read again when it is stale."""
        view = self._fresh_view(queue)
        if view is None:
            view = self.views[queue] = yield from read_view(keys, queue)
        return view

    def _fresh_view(self, queue: str) -> View | None:
        """The queue's view, None if it is not yet read or stale."""
        view = self.views.get(queue)
        return None if view is None or time.monotonic() - view.read_at >= self.refresh_s else view

    def _place(self, view: View, key: bytes, keys: Keys, queue: str) -> str | None:
        chosen = view.choose(key)
        if chosen is None:
            self.placed[Placed.SHARED] += 1
            return None
        chosen.load += 1
        self.placed[Placed.AFFINITY] += 1
        return keys.own_queue(queue, chosen.name)
