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

from producer_client.keys import Keys

SEPARATOR = "@"


def entry_ref(entry_id: str, owner: str | None) -> str:
    """How the worker names an entry of the shared stream (owner None) or of `owner`'s stream."""
    return entry_id if owner is None else f"{entry_id}{SEPARATOR}{owner}"


def owner_of(ref: str) -> str | None:
    return ref.partition(SEPARATOR)[2] or None


def entry_id_of(ref: str) -> str:
    return ref.partition(SEPARATOR)[0]


class QueueStreams:
    """The stream keys of one queue: the shared one and each worker's own."""

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
