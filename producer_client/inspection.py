"""What the queues hold right now, for operators (`mili jobs`, `mili workers`, the board), read from
the keys protocol v1 already has, without a scan of the keyspace:

- waiting jobs: the entries past the consumer group's last-delivered id of every stream of the
  queue's jobs (producer_client.protocol.backlog: its own, its lanes', its workers');
- running jobs: the group's pending entries list (each entry's job, worker, deliveries, idle time);
- dead jobs: the dead-letter stream (producer_client.dead_letters);
- queues: the queue index `mili:queues`; workers: each queue's worker index and heartbeats.

Jobs that ended (done, failed, cancelled, expired) have no index: their hashes are spread over the
keyspace (over every shard of a cluster) and are found by id only.

A heartbeat's age and the time a job has waited are measured on Redis's clock (TIME), as the
workers write them. A heartbeat is *stale* once it is older than the time it has left to live,
that is past half its TTL: its worker has missed several beats and is about to count as dead.
A worker whose heartbeat has expired is *gone*; its name stays in the worker index for an hour.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from producer_client.dead_letters import DeadLetterNotFound
from producer_client.dead_letters import find as find_letter
from producer_client.keys import DEFAULT_LANE, GROUP, NO_TENANT, Keys
from producer_client.protocol.backlog import QueueStream, entry_stream, read_queue_streams, read_streams
from producer_client.protocol.clock import entry_age_s, entry_order, epoch_ms
from producer_client.schema import JobStatus, WorkerInfo
from producer_client.steps import Steps, checked
from producer_client.validation import check_limit

GONE_SHOWN = 10  # gone workers listed per queue, the most recent first
WAITING_SCAN = 1000  # entries read from the head of each queue to find a queued job's


class WaitingJob(BaseModel):
    queue: str
    job_id: str
    entry_id: str
    waited_s: float  # since its enqueue
    lane: str
    tenant: str | None  # None: of no tenant
    worker: str | None  # the worker it was placed on; None: in the queue's or a lane's stream
    fields: dict[str, str]  # the entry: id, v, body (and a lane stream's or a placed entry's route)


class RunningJob(BaseModel):
    queue: str
    job_id: str
    entry_id: str
    worker: str  # the consumer that holds the entry
    deliveries: int
    idle_s: float  # since its worker last refreshed it (every heartbeat) or took it
    tokens: int  # generated so far
    lane: str
    tenant: str | None  # None: of no tenant
    placed_on: str | None  # the worker whose own stream holds the entry; None: the queue's or a lane's


class JobEntry(BaseModel):
    """Where a job's body is while its entry lives: in a queue stream, or in a dead letter."""

    queue: str
    entry_id: str  # the queue entry's id, or the dead letter's
    place: Literal["running", "waiting", "dead letter"]
    fields: dict[str, str]


class QueueOverview(BaseModel):
    queue: str
    depth: int
    pending: int
    waiting: int
    dead: int  # letters in the dead-letter stream
    oldest_waiting_s: float | None  # None: nothing waits
    # Entries that have left the stream since it was created (acknowledged or dead-lettered), from
    # XINFO STREAM's entries-added: its growth over time is the queue's throughput. None: no stream.
    processed: int | None
    at: float  # Redis's clock when read, epoch seconds


class WorkerHealth(BaseModel):
    name: str
    queue: str
    condition: Literal["live", "stale", "gone"]
    heartbeat_age_s: float
    info: WorkerInfo | None  # None once gone


class QueueInspector:
    """Read-only views of `queue` (and of every worker). Each method returns its outcome; over an
    asyncio client (`run` is steps.arun) it returns an awaitable of it."""

    def __init__(self, client, keys: Keys, queue: str, run):
        self.client = client
        self.keys = keys
        self.queue = queue
        self.run = run

    def queues(self) -> Any:
        """Every queue a worker has served in the last hour, from the queue index."""
        return self.run(self.client, queue_names(self.keys))

    def overview(self) -> Any:
        return self.run(self.client, overview(self.keys, self.queue))

    def waiting(self, limit: int) -> Any:
        """The first `limit` jobs no worker has read yet, oldest first."""
        return self.run(self.client, waiting(self.keys, self.queue, check_limit(limit)))

    def running(self, limit: int) -> Any:
        """Up to `limit` jobs that workers hold, oldest entry first."""
        return self.run(self.client, running(self.keys, self.queue, check_limit(limit)))

    def workers(self) -> Any:
        """Every worker of every queue: live and stale ones, and the most recently gone."""
        return self.run(self.client, worker_health(self.keys))

    def entry_of(self, status: JobStatus, queues: list[str]) -> Any:
        """The job's entry, looked for in `queues`: a running job's by its reference (its stream and
        id), a queued job's among the first WAITING_SCAN entries of each stream of each queue, a
        poison job's among the dead letters. None for any other job: its entry is deleted once it
        ends, and its body with it."""
        return self.run(self.client, entry_of(self.keys, status, queues))


def queue_names(keys: Keys) -> Steps[list[str]]:
    (names,) = checked((yield lambda pipe: pipe.zrange(keys.queues(), 0, -1)))
    return names


def overview(keys: Keys, queue: str) -> Steps[QueueOverview]:
    """Over every stream of the queue's jobs (protocol.backlog)."""
    _, streams = yield from read_queue_streams(keys, queue)
    readings = yield from read_streams(streams)
    unread = [r for r in readings if r.stats().waiting]

    def add(pipe) -> None:
        pipe.time()
        pipe.xlen(keys.dead(queue))
        for r in readings:
            pipe.xinfo_stream(r.stream.key)
        for r in unread:
            pipe.xrange(r.stream.key, r.unread_after(), "+", count=1)

    now, dead, *replies = yield add
    checked([now, dead, *replies[len(readings) :]])
    infos = [info for info in replies[: len(readings)] if _exists(info)]  # XINFO fails on a missing stream
    heads = [entries[0][0] for entries in replies[len(readings) :] if entries]
    now_ms = epoch_ms(now)
    stats = [r.stats() for r in readings]
    return QueueOverview(
        queue=queue,
        depth=sum(s.depth for s in stats),
        pending=sum(s.pending for s in stats),
        waiting=sum(s.waiting for s in stats),
        dead=dead,
        oldest_waiting_s=max(entry_age_s(entry_id, now_ms) for entry_id in heads) if heads else None,
        processed=sum(info["entries-added"] - info["length"] for info in infos) if infos else None,
        at=now_ms / 1000,
    )


def waiting(keys: Keys, queue: str, limit: int) -> Steps[list[WaitingJob]]:
    """The oldest `limit` jobs no worker has read, over every stream of the queue's jobs: the first
    `limit` of each stream's unread entries, merged by age."""
    _, streams = yield from read_queue_streams(keys, queue)
    unread = [r for r in (yield from read_streams(streams)) if r.stats().waiting]
    if not unread:
        return []

    def add(pipe) -> None:
        pipe.time()
        for r in unread:
            pipe.xrange(r.stream.key, r.unread_after(), "+", count=limit)

    now, *found = checked((yield add))
    now_ms = epoch_ms(now)
    jobs = [
        waiting_job(queue, r.stream, entry_id, fields, now_ms)
        for r, entries in zip(unread, found)
        for entry_id, fields in entries
    ]
    return sorted(jobs, key=lambda job: -job.waited_s)[:limit]


def route_of(stream: QueueStream, fields: dict[str, str]) -> tuple[str, str | None]:
    """An entry's lane and tenant (None: no tenant). A worker's stream names no lane: its entries
    carry their own (none: the default lane's, of no tenant)."""
    lane = stream.lane if stream.worker is None else fields.get("lane", DEFAULT_LANE)
    tenant = stream.tenant if stream.worker is None else fields.get("tenant", NO_TENANT)
    return lane, None if tenant == NO_TENANT else tenant


def waiting_job(queue: str, stream: QueueStream, entry_id: str, fields: dict[str, str], now_ms: int) -> WaitingJob:
    lane, tenant = route_of(stream, fields)
    return WaitingJob(
        queue=queue,
        job_id=fields.get("id", ""),
        entry_id=entry_id,
        waited_s=entry_age_s(entry_id, now_ms),
        lane=lane,
        tenant=tenant,
        worker=stream.worker,
        fields=fields,
    )


def running(keys: Keys, queue: str, limit: int) -> Steps[list[RunningJob]]:
    """Up to `limit` entries workers hold, over every stream of the queue's jobs, oldest first: the
    first `limit` of each stream's pending entries list, merged by entry id."""
    _, streams = yield from read_queue_streams(keys, queue)
    held = [r.stream for r in (yield from read_streams(streams)) if r.stats().pending]
    if not held:
        return []
    lists = checked((yield lambda pipe: [pipe.xpending_range(s.key, GROUP, "-", "+", limit) for s in held]))
    pending = sorted(
        ((s, p) for s, entries in zip(held, lists) for p in entries), key=lambda sp: entry_order(sp[1]["message_id"])
    )[:limit]

    def add_entries(pipe) -> None:
        for s, p in pending:
            pipe.xrange(s.key, p["message_id"], p["message_id"])

    entries = [found[0][1] if found else {} for found in checked((yield add_entries))]
    tokens = checked((yield lambda pipe: [pipe.hget(keys.job(fields.get("id", "")), "tokens") for fields in entries]))
    return [
        RunningJob(
            queue=queue,
            job_id=fields.get("id", ""),
            entry_id=p["message_id"],
            worker=p["consumer"],
            deliveries=p["times_delivered"],
            idle_s=p["time_since_delivered"] / 1000,
            tokens=int(t or 0),
            lane=route_of(s, fields)[0],
            tenant=route_of(s, fields)[1],
            placed_on=s.worker,
        )
        for (s, p), fields, t in zip(pending, entries, tokens)
    ]


def entry_of(keys: Keys, status: JobStatus, queues: list[str]) -> Steps[JobEntry | None]:
    (ref,) = checked((yield lambda pipe: pipe.hget(keys.job(status.id), "entry")))
    if ref:
        # The entry's reference names its stream: the queue's own, a lane's, or a worker's.
        located = [(queue, *entry_stream(keys, queue, ref)) for queue in queues]

        def add_lookups(pipe) -> None:
            for _, stream, entry_id in located:
                pipe.xrange(stream, entry_id, entry_id)

        for (queue, _, entry_id), entries in zip(located, checked((yield add_lookups))):
            if entries and entries[0][1].get("id") == status.id:
                return JobEntry(queue=queue, entry_id=entry_id, place="running", fields=entries[0][1])
    if status.status == "queued":
        # From each stream's head, not past the last-delivered id: a worker may have read the entry
        # and not yet claimed the job. Every stream of each queue's jobs (protocol.backlog).
        heads = []
        for queue in queues:
            _, streams = yield from read_queue_streams(keys, queue)
            heads += [(queue, s.key) for s in streams]

        def add_heads(pipe) -> None:
            for _, stream in heads:
                pipe.xrange(stream, "-", "+", count=WAITING_SCAN)

        for (queue, _), entries in zip(heads, checked((yield add_heads))):
            for entry_id, fields in entries:
                if fields.get("id") == status.id:
                    return JobEntry(queue=queue, entry_id=entry_id, place="waiting", fields=fields)
    error = status.result.error if status.result is not None else None
    if error is not None and error.code == "poison":
        for queue in queues:
            try:
                letter = yield from find_letter(keys, queue, status.id)
            except DeadLetterNotFound:
                continue
            return JobEntry(queue=queue, entry_id=letter.letter_id, place="dead letter", fields=letter.fields)
    return None


def worker_health(keys: Keys) -> Steps[list[WorkerHealth]]:
    queues = yield from queue_names(keys)

    def add_indexes(pipe) -> None:
        pipe.time()
        for queue in queues:
            pipe.zrange(keys.workers(queue), 0, -1, withscores=True)

    now, *indexes = checked((yield add_indexes))
    named = [(queue, name, seen) for queue, index in zip(queues, indexes) for name, seen in index]

    def add_heartbeats(pipe) -> None:
        for _, name, _ in named:
            pipe.hgetall(keys.worker(name))
            pipe.pttl(keys.worker(name))

    replies = checked((yield add_heartbeats))
    at = epoch_ms(now) / 1000
    rows = [
        health(queue, name, at - seen, heartbeat, ttl_ms)
        for (queue, name, seen), heartbeat, ttl_ms in zip(named, replies[::2], replies[1::2])
    ]
    live = [r for r in rows if r.condition != "gone"]
    gone = sorted((r for r in rows if r.condition == "gone"), key=lambda r: r.heartbeat_age_s)
    recent_gone = [r for queue in queues for r in [g for g in gone if g.queue == queue][:GONE_SHOWN]]
    return sorted(live, key=lambda r: (r.queue, r.name)) + recent_gone


def health(queue: str, name: str, age_s: float, heartbeat: dict[str, str], ttl_ms: int) -> WorkerHealth:
    """From the worker index's score (the last heartbeat's time), HGETALL and PTTL."""
    if not heartbeat:
        return WorkerHealth(name=name, queue=queue, condition="gone", heartbeat_age_s=age_s, info=None)
    stale = ttl_ms >= 0 and age_s > ttl_ms / 1000
    return WorkerHealth(
        name=name,
        queue=queue,
        condition="stale" if stale else "live",
        heartbeat_age_s=max(0.0, age_s),
        info=WorkerInfo.model_validate(heartbeat),
    )


def _exists(reply: object) -> bool:
    """False for the error XINFO and XPENDING give on a key that does not exist; other errors raise."""
    if isinstance(reply, Exception):
        if "no such key" in str(reply).lower() or "nogroup" in str(reply).lower():
            return False
        raise reply
    return True
