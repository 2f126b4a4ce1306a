"""A worker's commands on the consumer group `workers` (keys.GROUP) of the streams it reads as
itself, outside the worker's scripts (protocol.worker): the group created and looked up on the
queue's own stream, the worker's own stream and the doorbell, and XREADGROUP on them, and the entries it is done with acknowledged and deleted. The doorbell
(keys.doorbell) is the stream a producer rings when it gives a lane work: an idle worker blocks on
it beside the queue's stream, and acknowledges and deletes the entries that woke it."""

from __future__ import annotations

import redis

from producer_client.cluster import SyncRedis
from producer_client.keys import GROUP, Keys
from producer_client.protocol.execution import Pipe


def create_group(client: SyncRedis, stream: str, make_stream: bool) -> None:
    """The group on `stream`, from id 0 (not $: entries added before it was made are read too);
    `make_stream` creates an empty stream if there is none. A group that exists (BUSYGROUP) is left
    as it is."""
    try:
        client.xgroup_create(stream, GROUP, id="0", mkstream=make_stream)
    except redis.ResponseError as e:
        if "BUSYGROUP" not in str(e):
            raise


def has_group(client: SyncRedis, stream: str) -> bool:
    """Whether `stream` has the group, from XINFO GROUPS, which fails with a ResponseError on a
    stream that does not exist: the caller tells that from a transient failure."""
    return any(g["name"] == GROUP for g in client.xinfo_groups(stream))


def doorbell_made(client: SyncRedis, keys: Keys, queue: str) -> bool:
    """Whether a producer has rung the queue's doorbell yet (a queue without lanes has none)."""
    return bool(client.exists(keys.doorbell(queue)))


def add_doorbell_made(pipe: Pipe, keys: Keys, queue: str) -> None:
    """doorbell_made's EXISTS in a pipeline: its reply, 1 once a producer has rung the doorbell."""
    pipe.exists(keys.doorbell(queue))


def add_read(pipe: Pipe, worker: str, streams: dict[str, str], count: int, block_ms: int | None) -> None:
    """XREADGROUP as `worker` of up to `count` entries after each stream's id (">": never delivered
    to any consumer), blocking up to `block_ms` (None: not at all). Its reply: [(stream, [(entry
    id, fields)...])...], or None when nothing came."""
    pipe.xreadgroup(GROUP, worker, streams, count=count, block=block_ms)


def add_lanes_active(pipe: Pipe, lanes: list[str]) -> None:
    """EXISTS of lanes' sorted sets of active tenants (keys.lane): its reply, how many of them have
    a tenant whose stream holds entries nobody has read (Redis deletes a set with its last member:
    protocol.lanes)."""
    pipe.exists(*lanes)


def add_settled(pipe: Pipe, stream: str, entry_ids: list[str]) -> None:
    """Entries done with, acknowledged (out of the pending list) and deleted: a stream holds only
    what waits or runs."""
    pipe.xack(stream, GROUP, *entry_ids)
    pipe.xdel(stream, *entry_ids)


def add_bells_answered(pipe: Pipe, keys: Keys, queue: str, bells: list[str]) -> None:
    """The doorbell's entries that woke this worker, acknowledged and deleted."""
    add_settled(pipe, keys.doorbell(queue), bells)
