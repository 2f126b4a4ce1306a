"""A queue spread over shards (docs/architecture.md, "A queue over several shards"): how many it
has, which one a job goes to, and the names their keys are formed with (keys.Keys.shard).

The count is the queue's, not a process's: the first worker or producer that names one writes it
(SHARDS_FIELD in the queue's scheduler hash, which every producer's ACL may read, by the script STORE_SHARDS) and everyone else that names one must name the same, or gets
ShardCountMismatch before it enqueues or reads anything. A producer that names none writes every
job to shard 0, which is always read: an older producer, or one with the default, is still served.
A job's shard is a hash of its id, so the same request_id always lands on the same shard."""

from __future__ import annotations

import time
import zlib
from typing import Any, Final, Literal

from producer_client.connection import unless_other_type
from producer_client.errors import InvalidArgument, InvalidShardCount, ShardCountMismatch
from producer_client.keys import MAX_SHARDS, SHARDS_FIELD, Keys
from producer_client.protocol.producer import store_shards
from producer_client.steps import Steps, checked

# A producer's count: each queue's own, as stored, read every AUTO_REFRESH_S. A worker's: the
# queue's stored count, or the cluster's count of masters stored first (serving_count).
AUTO: Final = "auto"


def check_shards(field: str, value: Any) -> int:
    """`value` if it can be a queue's shard count (1 to MAX_SHARDS), else InvalidArgument."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SHARDS:
        raise InvalidArgument(field, f"must be an integer from 1 to {MAX_SHARDS}")
    return value


def check_count_or_auto(field: str, value: Any) -> int | Literal["auto"]:
    """`value` if it is AUTO or can be a queue's shard count, else InvalidArgument."""
    if isinstance(value, str) and value == AUTO:
        return AUTO
    try:
        return check_shards(field, value)
    except InvalidArgument:
        raise InvalidArgument(field, f"must be an integer from 1 to {MAX_SHARDS}, or {AUTO!r}") from None


def shard_of(job_id: str, count: int) -> int:
    """The shard of `count` that the job `job_id` goes to."""
    return 0 if count == 1 else zlib.crc32(job_id.encode()) % count


def shard_names(queue: str, count: int) -> list[str]:
    """The names every shard's keys are formed with, shard 0 (the queue's own) first."""
    return [Keys.shard(queue, i) for i in range(count)]


def parse_count(queue: str, reply: str | bytes | None) -> int:
    """The stored count (HGET's reply); absent: 1. Anything else than a count (the field is in a hash
    producers may write) raises InvalidShardCount."""
    if reply is None:
        return 1
    text = reply.decode(errors="replace") if isinstance(reply, bytes) else reply
    if not text.isdigit() or not 1 <= int(text) <= MAX_SHARDS:
        raise InvalidShardCount(queue, text, MAX_SHARDS)
    return int(text)


def stored_or_written(keys: Keys, queue: str, count: int) -> Steps[int]:
    """The queue's stored count, after writing `count` as that count if none is stored yet (first
    writer wins). It reads first, and writes only when nothing is stored (a second round trip, once
    per queue): a worker or producer that starts while Redis refuses writes (over maxmemory, a
    read-only replica promoted late) still starts on a queue whose count is stored."""
    stored = yield from stored_field(keys, queue)
    if stored is None:
        (stored,) = checked((yield store_shards(keys.scheduler(queue), SHARDS_FIELD, count).add_to))
    return parse_count(queue, stored)


def agree(keys: Keys, queue: str, count: int) -> Steps[int]:
    """Writes `count` as the queue's shard count if none is stored yet (first writer wins) and
    returns it; raises ShardCountMismatch if another count is stored."""
    stored = yield from stored_or_written(keys, queue, count)
    if stored != count:
        raise ShardCountMismatch(queue, count, stored)
    return count


def stored_count(keys: Keys, queue: str) -> Steps[int]:
    """The queue's shard count (1 when none is stored)."""
    return parse_count(queue, (yield from stored_field(keys, queue)))


def stored_field(keys: Keys, queue: str) -> Steps[str | bytes | None]:
    """The count's field as stored, unparsed (None when absent). A scheduler hash of another type (a
    producer may write it) holds none: the DEL that changed its type took it, and the scripts read
    it so too (protocol.lanes.LUA_LANES); its WRONGTYPE reached every producer that reads the count."""
    (reply,) = yield lambda pipe: pipe.hget(keys.scheduler(queue), SHARDS_FIELD)
    stored: str | bytes | None = unless_other_type(reply, None)
    return stored


def serving_count(keys: Keys, queue: str, asked: int | Literal["auto"] | None, masters: int) -> Steps[int]:
    """How many shards a worker reads: `asked` once agreed (agree); with None the queue's stored
    count (1 when none is stored), so that a worker started without one reads them all; with AUTO
    the stored count too, after storing `masters` (the cluster's, at most MAX_SHARDS) if none was:
    a count stored already wins, as "auto" names none that could disagree."""
    if isinstance(asked, int):
        return (yield from agree(keys, queue, asked))
    if asked is None:
        return (yield from stored_count(keys, queue))
    return (yield from stored_or_written(keys, queue, min(masters, MAX_SHARDS)))


# How stale an "auto" producer's copy of a queue's count may be: a queue that gets a count after
# the producer read none is spread within this long (its jobs meanwhile go to shard 0, still read).
AUTO_REFRESH_S = 10.0


class QueueShards:
    """A producer's shard count: a number, checked against each queue's once (a client made by
    on_queue shares it), or AUTO, each queue's stored count, read again every AUTO_REFRESH_S."""

    def __init__(self, count: int | Literal["auto"] = 1):
        checked = check_count_or_auto("queue_shards", count)
        self.auto = not isinstance(checked, int)
        self.count = checked if isinstance(checked, int) else 1
        self.spreads = self.auto or self.count > 1  # whether any job may go past shard 0
        self.counts: dict[str, tuple[int, float]] = {}  # queue -> (its count, when it was read)

    def agree(self, keys: Keys, queue: str) -> Steps[None]:
        """A number: checks it against `queue`'s the first time (a round trip), then never again,
        as a queue's count does not change while it has jobs (docs/architecture.md). AUTO: reads
        the queue's count when the copy is older than AUTO_REFRESH_S."""
        known = self.counts.get(queue)
        if known is not None and not (self.auto and time.monotonic() - known[1] > AUTO_REFRESH_S):
            return
        if self.auto:
            count = yield from stored_count(keys, queue)
        else:
            count = yield from agree(keys, queue, self.count)
        self.counts[queue] = (count, time.monotonic())

    def count_of(self, queue: str) -> int:
        """The count this producer spreads `queue`'s jobs over (after agree)."""
        known = self.counts.get(queue)
        return self.count if known is None else known[0]

    def name_for(self, queue: str, job_id: str) -> str:
        """The name of the shard `job_id` goes to (`queue` itself with one shard)."""
        count = self.count_of(queue)
        return queue if count == 1 else Keys.shard(queue, shard_of(job_id, count))


ONE_SHARD = QueueShards()  # a queue's jobs all on shard 0: the queue itself
