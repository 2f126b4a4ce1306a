"""Every stream that holds a queue's jobs, and what each holds: the one definition of "the queue's
jobs" that `mili stats`, `mili jobs`, the board, the metrics and the autoscaler's gauge read.

A queue's jobs wait in three kinds of stream (docs/architecture.md): the queue's own stream (the
default lane's jobs of no tenant); one stream per lane and tenant that has had jobs, listed in the
queue's set of lane streams; and the own stream of each worker in the queue's index, where
placement puts jobs. A worker's name stays in the index for an hour after it is gone, and so its
stream is still read: what was placed on a gone worker waits there until another worker steals it.
Each kind is read through the consumer group `workers`: its lag is what waits, its pending entries
what runs."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any, TypedDict, TypeGuard

from producer_client.connection import is_other_type, unless_other_type
from producer_client.keys import DEFAULT_LANE, GROUP, NO_TENANT, SHARDS_FIELD, Keys
from producer_client.protocol.shards import parse_count
from producer_client.schema import StreamStats
from producer_client.steps import Steps, checked

# How a worker names an entry it holds, and CLAIM records as the job's `entry` (worker/loop/streams.py):
# `<entry id>` in the queue's own stream, `<entry id>@<owner>` in worker `owner`'s own stream,
# `<entry id>#<lane>:<tenant>` in a lane's stream of a tenant. An entry id is digits and one dash, so
# the first `@` or `#` ends it.
# On a queue of several shards, an entry of shard i > 0 (its own stream or a lane's) is named
# `<entry id>%<i>` and then its reference within the shard: `1700000000000-0%2#flex:team-a`. No
# name or tenant holds `%`.
OWNED, LANED, SHARDED = "@", "#", "%"
MARK = re.compile(f"([{OWNED}{LANED}])")


def shard_parts(ref: str) -> tuple[int, str]:
    """The shard an entry reference names (0 when it names none) and the reference within it."""
    if SHARDED not in ref:
        return 0, ref
    entry_id, _, rest = ref.partition(SHARDED)
    shard = rest[: len(rest) - len(rest.lstrip("0123456789"))]
    return int(shard), entry_id + rest[len(shard) :]


def shard_ref(ref: str, shard: int) -> str:
    """The reference of the entry `ref` names within shard `shard` (unchanged for shard 0)."""
    if shard == 0:
        return ref
    entry_id, mark, rest = reference_parts(ref)
    return f"{entry_id}{SHARDED}{shard}{mark}{rest}"


# A worker asks this of each entry it holds about five times (its route, its owner, its stream, its
# id): cached, the later asks are one C call each. An entry's parts never change.
@functools.lru_cache(maxsize=4096)
def reference_parts(ref: str) -> tuple[str, str, str]:
    """An entry reference's entry id, its mark (OWNED, LANED, or "" in the queue's own stream) and
    what follows the mark (the owner, or `<lane>:<tenant>`), whatever its shard."""
    if SHARDED in ref:
        ref = shard_parts(ref)[1]
    parts = MARK.split(ref, maxsplit=1)
    return (ref, "", "") if len(parts) == 1 else (parts[0], parts[1], parts[2])


def entry_stream(keys: Keys, queue: str, ref: str) -> tuple[str, str]:
    """The stream key and the entry id that the entry reference `ref` names in `queue`."""
    shard, ref = shard_parts(ref)
    entry_id, mark, rest = reference_parts(ref)
    if mark == OWNED:
        return keys.own_queue(queue, rest), entry_id
    queue = keys.shard(queue, shard)
    if mark == LANED:
        lane, _, tenant = rest.partition(":")
        return keys.lane_stream(queue, lane, tenant), entry_id
    return keys.queue(queue), entry_id


@dataclass(frozen=True)
class QueueStream:
    """A stream of the queue's jobs: a lane's of a tenant (the queue's own stream is the default
    lane's of NO_TENANT), or a worker's own (`worker` set; its entries name their lane and tenant)."""

    key: str
    lane: str | None = None
    tenant: str = NO_TENANT
    worker: str | None = None
    shard: int = 0


def queue_streams(keys: Keys, queue: str, members: list[set[str]], workers: list[str]) -> list[QueueStream]:
    """Each shard's own stream and then its lane streams (`members`: each shard's set of lane
    streams' `<lane>:<tenant>`) in order, shard 0 (the queue's own keys) first; then each worker's
    own stream in the index's order."""
    streams = []
    for shard, shard_members in enumerate(members):
        name = keys.shard(queue, shard)
        routes = [(DEFAULT_LANE, NO_TENANT), *sorted(tuple(member.split(":", 1)) for member in shard_members)]
        streams += [
            QueueStream(keys.lane_stream(name, lane, tenant), lane, tenant, shard=shard) for lane, tenant in routes
        ]
    return streams + [QueueStream(keys.own_queue(queue, name), worker=name) for name in workers]


def read_queue_streams(keys: Keys, queue: str) -> Steps[tuple[list[str], list[QueueStream]]]:
    """The queue's worker index (its workers' names, gone ones too) and every stream of its jobs:
    one round trip, and a second for the other shards' sets of lane streams on a queue of several."""
    sched = keys.scheduler(queue)
    names, members, count = yield lambda pipe: (
        pipe.zrange(keys.workers(queue), 0, -1),
        pipe.smembers(keys.lane_streams(queue)),
        pipe.hget(sched, SHARDS_FIELD),
    )
    names = unless_other_type(names, [])  # the worker index: registry.py reads one of another type as missing
    shards = [unless_other_type(members, set())]
    shard_count = parse_count(queue, unless_other_type(count, None))
    if shard_count > 1:
        others = [keys.lane_streams(keys.shard(queue, i)) for i in range(1, shard_count)]
        shards += [unless_other_type(r, set()) for r in (yield lambda pipe: [pipe.smembers(key) for key in others])]
    return names, queue_streams(keys, queue, shards, names)


# What redis-py parses from XINFO GROUPS (one group's), XINFO STREAM and XPENDING's extended form
# (one entry): the fields read here. A group's lag is None where Redis cannot tell it.
GroupInfo = TypedDict("GroupInfo", {"name": str, "pending": int, "lag": "int | None", "last-delivered-id": str})
StreamInfo = TypedDict("StreamInfo", {"entries-added": int, "length": int})


class PendingEntry(TypedDict):
    message_id: str
    consumer: str
    time_since_delivered: int  # ms
    times_delivered: int


@dataclass(frozen=True)
class StreamReading:
    """A stream's XLEN and XINFO GROUPS (empty when it holds nothing)."""

    stream: QueueStream
    depth: int
    groups: list[GroupInfo]

    def stats(self) -> StreamStats:
        return stream_stats(self.stream, self.depth, self.groups)

    def unread_after(self) -> str:
        """XRANGE's start for the entries no worker has read yet."""
        group = next((g for g in self.groups if g["name"] == GROUP), None)
        return "-" if group is None else "(" + group["last-delivered-id"]

    def add_unread(self, pipe: Any, count: int) -> None:
        """XRANGE of the first `count` entries no worker has read yet, among a pipeline's reads."""
        pipe.xrange(self.stream.key, self.unread_after(), "+", count=count)


def read_streams(streams: list[QueueStream]) -> Steps[list[StreamReading]]:
    """XLEN of each stream, then XINFO GROUPS of those that hold entries (it fails on a stream that
    does not exist). Two round trips; on a cluster the workers' streams lie on other shards, and
    each round trip goes to all of them at once. A stream a producer made another type holds no
    jobs (they went with the DEL that changed its type): it reads as empty, and stops no stats,
    listing, board or metrics read of the queue's other streams."""
    depths = [unless_other_type(reply, 0) for reply in (yield lambda pipe: [pipe.xlen(s.key) for s in streams])]
    held = [i for i, depth in enumerate(depths) if depth]
    replies = checked((yield lambda pipe: [pipe.xinfo_groups(streams[i].key) for i in held])) if held else []
    groups = dict(zip(held, replies))
    return [StreamReading(s, depths[i], groups.get(i, [])) for i, s in enumerate(streams)]


def read_backlogs(streams: list[QueueStream]) -> Steps[list[StreamStats]]:
    """Each stream's depth, pending and waiting entries (read_streams)."""
    return [reading.stats() for reading in (yield from read_streams(streams))]


def add_stream_info(pipe: Any, stream: QueueStream) -> None:
    """XINFO STREAM, among a pipeline's reads; its reply is an error if the stream does not exist
    (processed)."""
    pipe.xinfo_stream(stream.key)


def processed(infos: list[StreamInfo | Exception]) -> int | None:
    """The entries that have left the streams since each was created (acknowledged or
    dead-lettered), from their XINFO STREAM: entries-added less the length. None: no stream exists."""
    found = [info for info in infos if stream_exists(info)]
    return sum(info["entries-added"] - info["length"] for info in found) if found else None


def stream_exists(reply: StreamInfo | Exception) -> TypeGuard[StreamInfo]:
    """False for the error XINFO gives on a key that does not exist, or one of another type (as
    read_streams reads it); other errors raise."""
    if isinstance(reply, Exception):
        if "no such key" in str(reply).lower() or "nogroup" in str(reply).lower() or is_other_type(reply):
            return False
        raise reply
    return True


def pending_entries(streams: list[QueueStream], count: int) -> Steps[list[list[PendingEntry]]]:
    """The first `count` entries of each stream's pending entries list (XPENDING, extended form):
    message_id, consumer, time_since_delivered (ms), times_delivered."""
    if not streams:
        return []
    return checked((yield lambda pipe: [pipe.xpending_range(s.key, GROUP, "-", "+", count) for s in streams]))


def entries_at(places: list[tuple[str, str]]) -> Steps[list[dict[str, str] | None]]:
    """The fields of each (stream key, entry id)'s entry; None where it is gone."""
    if not places:
        return []
    found = checked((yield lambda pipe: [pipe.xrange(key, entry_id, entry_id) for key, entry_id in places]))
    return [entries[0][1] if entries else None for entries in found]


def stream_heads(stream_keys: list[str], count: int) -> Steps[list[list[tuple[str, dict[str, str]]]]]:
    """The first `count` entries of each stream, read or not."""
    if not stream_keys:
        return []
    return checked((yield lambda pipe: [pipe.xrange(key, "-", "+", count=count) for key in stream_keys]))


def backlog(depth: int, groups: list[GroupInfo]) -> tuple[int, int]:
    """(pending, waiting) of a stream of `depth` entries, from its XINFO GROUPS (empty when it
    has none)."""
    group = next((g for g in groups if g["name"] == GROUP), None)
    pending = group["pending"] if group else 0
    lag = group.get("lag") if group else None
    # Acked entries are deleted, so depth = waiting + pending whenever Redis cannot tell the lag.
    return pending, lag if lag is not None else depth - pending


def stream_stats(stream: QueueStream, depth: int, groups: list[GroupInfo]) -> StreamStats:
    pending, waiting = backlog(depth, groups)
    return StreamStats(
        shard=stream.shard,
        lane=stream.lane,
        tenant=None if stream.tenant == NO_TENANT else stream.tenant,
        worker=stream.worker,
        depth=depth,
        pending=pending,
        waiting=waiting,
    )
