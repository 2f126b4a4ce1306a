"""The registry of queues and workers: the queue index (every queue a worker has served in the last
WORKER_INDEX_RETENTION_S), each queue's worker index (its workers' names, each scored with its last
heartbeat's time) and each worker's heartbeat hash, whose TTL runs on Redis's clock: a worker whose
heartbeat has expired is dead. A worker writes them each heartbeat (add_heartbeat) and as it
leaves (add_leave); producers, `mili` and the board read them here. On a cluster the indexes and
heartbeats lie on many shards: each read is one round trip to all of them at once. A key of
them of another type reads as a missing one (unless_other_type): the worker's next heartbeat makes
it anew (heartbeat_key_types), and meanwhile no submit (placement's view), no listing and no stats
may fail on it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from producer_client.connection import unless_other_type
from producer_client.keys import Keys
from producer_client.steps import Steps, checked

# Names of workers whose heartbeat is this stale are dropped from the queue's worker index (and
# queues no worker has served for this long from the queue index).
WORKER_INDEX_RETENTION_S = 3600
HEARTBEAT_COMMANDS = 8  # what add_heartbeat adds; heartbeat_reply parses their replies


def add_heartbeat(
    pipe: Any, keys: Keys, queue: str, worker: str, fields: Mapping[str, str | int | float], ttl_ms: int, now: float
) -> None:
    """A worker's heartbeat at `now` (Redis's clock, epoch seconds): its hash with `fields` and a
    TTL of `ttl_ms`, its place in its queue's worker index and its queue's in the queue index
    (both pruned of what is older than the retention), then what it reads back: the depth of the
    queue's own stream and the worker index's names (heartbeat_reply)."""
    key, index = keys.worker(worker), keys.workers(queue)
    pipe.hset(key, mapping={**fields, "updated_at": now})
    pipe.pexpire(key, ttl_ms)
    pipe.zadd(index, {worker: now})
    pipe.zremrangebyscore(index, "-inf", now - WORKER_INDEX_RETENTION_S)
    pipe.zadd(keys.queues(), {queue: now})
    pipe.zremrangebyscore(keys.queues(), "-inf", now - WORKER_INDEX_RETENTION_S)
    pipe.xlen(keys.queue(queue))
    pipe.zrange(index, 0, -1)


def heartbeat_key_types(keys: Keys, queue: str, worker: str) -> dict[str, str]:
    """The registry's keys a worker's heartbeat writes, each with the type it holds. Only workers and
    operators may write them (docs/security.md), so one of another type is a mistake, and it held
    only what the heartbeats write anew: the worker deletes it (Membership.heartbeat)."""
    return {keys.worker(worker): "hash", keys.workers(queue): "zset", keys.queues(): "zset"}


def add_types(pipe: Any, keys: list[str]) -> None:
    """TYPE of each of `keys` (of heartbeat_key_types)."""
    for key in keys:
        pipe.type(key)


def add_deletes(pipe: Any, keys: list[str]) -> None:
    """DEL of each of `keys` (of heartbeat_key_types, found of another type): one a key, each in its slot."""
    for key in keys:
        pipe.delete(key)


def add_shard_depth(pipe: Any, stream: str) -> None:
    """The length of another shard's stream of the queue (a shard's own stream, `Keys.queue` of
    its name): a heartbeat's depth counts every shard's."""
    pipe.xlen(stream)


def heartbeat_reply(replies: list[Any]) -> tuple[int, list[str]]:
    """The queue's depth and its workers' names, from the replies of add_heartbeat's commands."""
    return replies[6], replies[7]


def add_leave(pipe: Any, keys: Keys, queue: str, worker: str, keep_name: bool) -> None:
    """The worker's heartbeat removed: it no longer counts as live. `keep_name`: its name stays in
    the worker index until the retention prunes it (placement: the index is where the others find
    its own stream)."""
    pipe.delete(keys.worker(worker))
    if not keep_name:
        pipe.zrem(keys.workers(queue), worker)


def queue_names(keys: Keys) -> Steps[list[str]]:
    """Every queue of the queue index."""
    (reply,) = yield lambda pipe: pipe.zrange(keys.queues(), 0, -1)
    names: list[str] = unless_other_type(reply, [])
    return names


def worker_names(keys: Keys, queues: list[str]) -> Steps[list[list[str]]]:
    """Each queue's worker index: its workers' names, gone ones too."""
    if not queues:
        return []
    replies = yield lambda pipe: [pipe.zrange(keys.workers(queue), 0, -1) for queue in queues]
    return [unless_other_type(names, []) for names in replies]


def beat_times(keys: Keys, queues: list[str]) -> Steps[tuple[tuple[int, int], list[list[tuple[str, float]]]]]:
    """Redis's clock (TIME), and each queue's worker index with each name's last heartbeat time."""

    def add(pipe: Any) -> None:
        pipe.time()
        for queue in queues:
            pipe.zrange(keys.workers(queue), 0, -1, withscores=True)

    now, *indexes = yield add
    return checked([now])[0], [unless_other_type(index, []) for index in indexes]


def heartbeats(keys: Keys, names: list[str]) -> Steps[list[dict[str, str]]]:
    """Each worker's heartbeat hash: empty once it has expired."""
    if not names:
        return []
    replies = yield lambda pipe: [pipe.hgetall(keys.worker(name)) for name in names]
    return [unless_other_type(beat, {}) for beat in replies]


def heartbeats_to_live(keys: Keys, names: list[str]) -> Steps[list[tuple[dict[str, str], int]]]:
    """Each worker's heartbeat hash and its time to live in ms (PTTL: negative once expired)."""
    if not names:
        return []

    def add(pipe: Any) -> None:
        for name in names:
            pipe.hgetall(keys.worker(name))
            pipe.pttl(keys.worker(name))

    replies = yield add
    beats = [unless_other_type(beat, {}) for beat in replies[::2]]
    return list(zip(beats, [unless_other_type(length, None) for length in replies[1::2]]))


def alive(keys: Keys, names: list[str]) -> Steps[list[bool]]:
    """Whether each worker's heartbeat hash still exists: its `updated_at`, which every heartbeat
    writes, by HGET (the producers' right on it; TYPE is not). EXISTS counted a key of another
    type, which for a gone worker no heartbeat makes anew and no TTL ends: live for ever, where
    workers() and the inspector read it as missing."""
    if not names:
        return []
    replies = yield lambda pipe: [pipe.hget(keys.worker(name), "updated_at") for name in names]
    return [unless_other_type(updated_at, None) is not None for updated_at in replies]


def heartbeats_and_own_depths(
    keys: Keys, queue: str, names: list[str]
) -> Steps[list[tuple[dict[str, str], int | None]]]:
    """Each worker's heartbeat hash and the length of its own stream of `queue` (where placement
    puts jobs; None where a producer made it another type, which the worker's READ makes anew):
    one round trip."""
    if not names:
        return []

    def add(pipe: Any) -> None:
        for name in names:
            pipe.hgetall(keys.worker(name))
            pipe.xlen(keys.own_queue(queue, name))

    replies = yield add
    beats = [unless_other_type(beat, {}) for beat in replies[::2]]
    return list(zip(beats, [unless_other_type(length, None) for length in replies[1::2]]))
