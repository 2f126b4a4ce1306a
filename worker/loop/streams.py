"""Which stream an entry a worker holds is in. With cache-aware placement (docs/architecture.md)
a worker takes entries from the queue's shared stream and from the workers' own streams (its own,
and others' when it steals or reclaims), and every part of the worker that names an entry
(claims, refreshes, acknowledgements, hand-overs, dead letters) names it by one string: the entry
id for the shared stream, as before, and `<entry id>@<owner>` for the stream of worker `owner`.
CLAIM records that string as the job's `entry`, so entries of two streams never pass for one.
An entry id is digits and one dash, so the first `@` ends it; entry_time() reads its milliseconds
either way."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

from producer_client.keys import GROUP, Keys
from producer_client.protocol import worker as scripts
from producer_client.protocol.execution import AddCommands, Pipe

SEPARATOR = "@"
# The dead-letter stream keeps about this many entries (XADD MAXLEN ~): bounded memory, and far
# more than an operator reads before acting on the alert.
DEAD_LETTER_MAXLEN = 10_000


def entry_ref(entry_id: str, owner: str | None) -> str:
    """How the worker names an entry of the shared stream (owner None) or of `owner`'s stream."""
    return entry_id if owner is None else f"{entry_id}{SEPARATOR}{owner}"


def owner_of(ref: str) -> str | None:
    return ref.partition(SEPARATOR)[2] or None


def entry_id_of(ref: str) -> str:
    return ref.partition(SEPARATOR)[0]


class QueueStreams:
    """The stream keys of one queue, the shared one and each worker's own, and the commands that
    settle entries named by reference, each on its own stream (no script spans two of them)."""

    def __init__(self, keys: Keys, queue: str):
        self.keys = keys
        self.queue = queue
        self.shared = keys.queue(queue)

    def of(self, owner: str | None) -> str:
        return self.shared if owner is None else self.keys.own_queue(self.queue, owner)

    def by_stream(self, refs: Iterable[str]) -> dict[str, list[str]]:
        """{stream key: [entry ids]} of the entries `refs` name, each stream's in the given order."""
        grouped: dict[str, list[str]] = defaultdict(list)
        for ref in refs:
            grouped[self.of(owner_of(ref))].append(entry_id_of(ref))
        return dict(grouped)

    def owners(self, refs: Iterable[str]) -> dict[str, str | None]:
        """{stream key: owner} of the streams `refs` name."""
        return {self.of(owner_of(ref)): owner_of(ref) for ref in refs}

    def add_acks(self, pipe: Pipe, refs: list[str]) -> None:
        for key, ids in self.by_stream(refs).items():
            pipe.xack(key, GROUP, *ids)
            pipe.xdel(key, *ids)

    def add_dead_letter(self, pipe: Pipe, ref: str, letter: dict[str, str | int | float]) -> None:
        """DEADLETTER (`letter`: the dead letter's fields) moves an entry of the shared stream in one step. A worker's
        stream has a hash tag of its own, so its entry is moved in two commands: written to the
        dead-letter stream, then acknowledged and deleted (a worker that dies in between leaves it
        pending, and the next one to take it writes the letter again)."""
        dead = self.keys.dead(self.queue)
        owner = owner_of(ref)
        if owner is None:
            scripts.deadletter(self.shared, dead, ref, DEAD_LETTER_MAXLEN, letter).add_to(pipe)
            return
        pipe.xadd(dead, letter, maxlen=DEAD_LETTER_MAXLEN, approximate=True)
        self.add_acks(pipe, [ref])

    @staticmethod
    def add_refreshes(pipe: Pipe, worker: str, by_stream: dict[str, list[str]]) -> None:
        """REFRESH of the held entries, one call per stream; each answers the ids it lost."""
        for key, ids in by_stream.items():
            scripts.refresh(key, worker, ids).add_to(pipe)

    @staticmethod
    def add_releases(worker: str, idle_ms: int, by_stream: dict[str, list[str]]) -> AddCommands:
        """RELEASE of the entries, one call per stream; each answers how many were the worker's."""

        def add(pipe: Pipe) -> None:
            for key, ids in by_stream.items():
                scripts.release(key, worker, idle_ms, ids).add_to(pipe)

        return add
