"""Which stream an entry a worker holds is in. A worker takes entries from the queue's own stream,
from the lanes' streams of each tenant (docs/architecture.md, "Sharing rules") and, with
cache-aware placement, from the workers' own streams (its own, and others' when it steals or
reclaims); every part of the worker that names an entry (claims, refreshes, acknowledgements,
hand-overs, dead letters) names it by one string, its reference: the entry id for the queue's own
stream, as before, `<entry id>@<owner>` for the stream of worker `owner`, and
`<entry id>#<lane>:<tenant>` for a lane's stream of a tenant, each with `%<i>` after the entry id
for shard i > 0 of a queue of several shards (backlog.shard_ref). CLAIM records that string as the
job's `entry`, so entries of two streams never pass for one. An entry id is digits and one dash,
and no worker name holds `#` nor any lane `:`, so the first `@` or `#` ends the id; entry_time()
reads its milliseconds either way."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from producer_client.keys import DEFAULT_LANE, NO_TENANT, Keys
from producer_client.protocol import consumer
from producer_client.protocol import worker as scripts
from producer_client.protocol.backlog import LANED, OWNED, entry_stream, reference_parts, shard_parts
from producer_client.protocol.execution import AddCommands, Pipe
from producer_client.protocol.letters import DEAD_LETTER_MAXLEN
from producer_client.protocol.shards import shard_names


@dataclass(frozen=True)
class Route:
    """The lane and tenant a job was submitted to: what it is charged to, and how the engine
    ranks it (worker/engine's lanes)."""

    lane: str = DEFAULT_LANE
    tenant: str = NO_TENANT


DEFAULT_ROUTE = Route()


def entry_ref(entry_id: str, owner: str | None) -> str:
    """How the worker names an entry of the shared stream (owner None) or of `owner`'s stream."""
    return entry_id if owner is None else f"{entry_id}{OWNED}{owner}"


def lane_ref(entry_id: str, route: Route) -> str:
    """How the worker names an entry of a lane's stream of a tenant (the queue's own stream for
    the default lane of no tenant)."""
    return entry_id if route == DEFAULT_ROUTE else f"{entry_id}{LANED}{route.lane}:{route.tenant}"


def owner_of(ref: str) -> str | None:
    entry_id, mark, rest = reference_parts(ref)
    return rest if mark == OWNED else None


def entry_id_of(ref: str) -> str:
    return reference_parts(ref)[0]


def route_of_ref(ref: str) -> Route | None:
    """The route a lane stream's reference names; None for the other streams' (the queue's own
    stream: the default route; a worker's own: the entry's fields say)."""
    entry_id, mark, rest = reference_parts(ref)
    if mark != LANED:
        return None
    lane, _, tenant = rest.partition(":")
    return Route(lane, tenant)


class QueueStreams:
    """The stream keys of one queue, the shared one, the lanes' and each worker's own, and the
    commands that settle entries named by reference, each on its own stream (no script spans two
    of them)."""

    def __init__(self, keys: Keys, queue: str):
        self.keys = keys
        self.queue = queue
        self.shared = keys.queue(queue)

    def of(self, owner: str | None) -> str:
        return self.shared if owner is None else self.keys.own_queue(self.queue, owner)

    def of_ref(self, ref: str) -> str:
        return entry_stream(self.keys, self.queue, ref)[0]

    def by_stream(self, refs: Iterable[str]) -> dict[str, dict[str, str]]:
        """{stream key: {entry id: reference}} of the entries `refs` name, each stream's in the
        given order."""
        grouped: dict[str, dict[str, str]] = defaultdict(dict)
        for ref in refs:
            grouped[self.of_ref(ref)][entry_id_of(ref)] = ref
        return dict(grouped)

    def add_acks(self, pipe: Pipe, refs: list[str]) -> None:
        for key, ids in self.by_stream(refs).items():
            consumer.add_settled(pipe, key, list(ids))

    def add_dead_letter(self, pipe: Pipe, ref: str, letter: dict[str, str | int | float]) -> None:
        """DEADLETTER (`letter`: the dead letter's fields) moves an entry of the shared stream or a
        lane's, which share the dead-letter stream's hash tag, in one step. A worker's stream has a
        hash tag of its own, so its entry is moved in two commands: written to the dead-letter
        stream (LETTER), then acknowledged and deleted (a worker that dies in between leaves it pending, and
        the next one to take it writes the letter again)."""
        if owner_of(ref) is None:  # the shard's own dead-letter stream, in the shard's slot
            dead = self.keys.dead(self.keys.shard(self.queue, shard_parts(ref)[0]))
            scripts.deadletter(self.of_ref(ref), dead, entry_id_of(ref), DEAD_LETTER_MAXLEN, letter).add_to(pipe)
            return
        scripts.letter(self.keys.dead(self.queue), DEAD_LETTER_MAXLEN, letter).add_to(pipe)
        self.add_acks(pipe, [ref])

    @staticmethod
    def add_refreshes(pipe: Pipe, worker: str, by_stream: dict[str, dict[str, str]]) -> None:
        """REFRESH of the held entries, one call per stream; each answers the ids it lost."""
        for key, ids in by_stream.items():
            scripts.refresh(key, worker, list(ids)).add_to(pipe)

    @staticmethod
    def add_releases(worker: str, idle_ms: int, by_stream: dict[str, dict[str, str]]) -> AddCommands:
        """RELEASE of the entries, one call per stream; each answers how many were the worker's."""

        def add(pipe: Pipe) -> None:
            for key, ids in by_stream.items():
                scripts.release(key, worker, idle_ms, list(ids)).add_to(pipe)

        return add


class QueueShards:
    """The queue's shards as this worker reads them (docs/architecture.md, "A queue over several
    shards"): each shard's name (keys.shard(queue, i); one shard is the queue's own keys alone), the
    shard of each shard's stream, and which shard is asked first, in turn: the reads move the turn
    on, and the reclaim scans and an idle wait on a cluster start where it stands."""

    def __init__(self, keys: Keys, queue: str, count: int):
        self.names = shard_names(queue, count)
        self.of_stream = {keys.queue(name): i for i, name in enumerate(self.names)}
        self.first = 0


def fields_of(flat: list[str]) -> dict[str, str]:
    """An entry's fields from Redis's flat list of names and values."""
    return dict(zip(flat[::2], flat[1::2]))
