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

from pydantic import BaseModel, ValidationError

from producer_client.cluster import AsyncRedis, SyncRedis
from producer_client.dead_letters import DeadLetterNotFound, find_in_any
from producer_client.keys import DEFAULT_LANE, NO_TENANT, Keys
from producer_client.protocol import letters as dead
from producer_client.protocol import registry
from producer_client.protocol.backlog import (
    QueueStream,
    add_stream_info,
    entries_at,
    entry_stream,
    pending_entries,
    processed,
    read_queue_streams,
    read_streams,
    stream_heads,
)
from producer_client.protocol.clock import entry_age_s, entry_order, epoch_ms
from producer_client.protocol.execution import Pipe
from producer_client.protocol.job_reads import field_of_jobs
from producer_client.schema import JobStatus, WorkerInfo
from producer_client.steps import Runner, Steps, checked
from producer_client.validation import DEFAULT_LIMIT, check_limit

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
    condition: Literal["live", "stale", "gone", "unreadable"]
    heartbeat_age_s: float
    info: WorkerInfo | None  # None once gone, or where the heartbeat does not parse (another version's)


class QueueInspector:
    """Read-only views of `queue` (and of every worker). Each method returns its outcome; over an
    asyncio client (`run` is steps.arun) it returns an awaitable of it."""

    def __init__(self, client: SyncRedis | AsyncRedis, keys: Keys, queue: str, run: Runner):
        self.client = client
        self.keys = keys
        self.queue = queue
        self.run = run

    def queues(self) -> Any:
        """Every queue a worker has served in the last hour, from the queue index."""
        return self.run(self.client, queue_names(self.keys))

    def overview(self) -> Any:
        return self.run(self.client, overview(self.keys, self.queue))

    def waiting(self, limit: int = DEFAULT_LIMIT) -> Any:
        """The first `limit` jobs no worker has read yet, oldest first."""
        return self.run(self.client, waiting(self.keys, self.queue, check_limit(limit)))

    def running(self, limit: int = DEFAULT_LIMIT) -> Any:
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
    names = yield from registry.queue_names(keys)
    return names


def overview(keys: Keys, queue: str) -> Steps[QueueOverview]:
    """Over every stream of the queue's jobs (protocol.backlog)."""
    _, streams = yield from read_queue_streams(keys, queue)
    readings = yield from read_streams(streams)
    unread = [r for r in readings if r.stats().waiting]

    def add(pipe: Pipe) -> None:
        pipe.time()
        for shard in shards:
            dead.add_letter_count(pipe, keys, keys.shard(queue, shard))
        for r in readings:
            add_stream_info(pipe, r.stream)
        for r in unread:
            r.add_unread(pipe, 1)

    shards = range(max(s.shard for s in streams) + 1)
    now, *replies = yield add
    counts, replies = replies[: len(shards)], replies[len(shards) :]
    infos, firsts = replies[: len(readings)], replies[len(readings) :]
    checked([now, *firsts])  # not the XINFO replies: errors on a stream that is gone (processed)
    letters = sum(dead.letter_count(count) for count in counts)
    heads = [entries[0][0] for entries in firsts if entries]
    now_ms = epoch_ms(now)
    stats = [r.stats() for r in readings]
    return QueueOverview(
        queue=queue,
        depth=sum(s.depth for s in stats),
        pending=sum(s.pending for s in stats),
        waiting=sum(s.waiting for s in stats),
        dead=letters,
        oldest_waiting_s=max(entry_age_s(entry_id, now_ms) for entry_id in heads) if heads else None,
        processed=processed(infos),
        at=now_ms / 1000,
    )


def waiting(keys: Keys, queue: str, limit: int) -> Steps[list[WaitingJob]]:
    """The oldest `limit` jobs no worker has read, over every stream of the queue's jobs: the first
    `limit` of each stream's unread entries, merged by age."""
    _, streams = yield from read_queue_streams(keys, queue)
    unread = [r for r in (yield from read_streams(streams)) if r.stats().waiting]
    if not unread:
        return []

    def add(pipe: Pipe) -> None:
        pipe.time()
        for r in unread:
            r.add_unread(pipe, limit)

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
    lane = stream.lane if stream.lane is not None else fields.get("lane", DEFAULT_LANE)
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
    lists = yield from pending_entries(held, limit)
    pending = sorted(
        ((s, p) for s, entries in zip(held, lists) for p in entries), key=lambda sp: entry_order(sp[1]["message_id"])
    )[:limit]
    entries = [fields or {} for fields in (yield from entries_at([(s.key, p["message_id"]) for s, p in pending]))]
    tokens = yield from field_of_jobs(keys, [fields.get("id", "") for fields in entries], "tokens")
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
    found = yield from running_entry(keys, status.id, queues)
    if found is None and status.status == "queued":
        found = yield from waiting_entry(keys, status.id, queues)
    error = status.result.error if status.result is not None else None
    if found is None and error is not None and error.code == "poison":
        found = yield from dead_entry(keys, status.id, queues)
    return found


def running_entry(keys: Keys, job_id: str, queues: list[str]) -> Steps[JobEntry | None]:
    """The entry the job was claimed from, by the reference its hash keeps, if it is still there."""
    (ref,) = yield from field_of_jobs(keys, [job_id], "entry")
    if not ref:
        return None
    # The entry's reference names its stream: the queue's own, a lane's, or a worker's.
    located = [(queue, *entry_stream(keys, queue, ref)) for queue in queues]
    found = yield from entries_at([(stream, entry_id) for _, stream, entry_id in located])
    for (queue, _, entry_id), fields in zip(located, found):
        if fields is not None and fields.get("id") == job_id:
            return JobEntry(queue=queue, entry_id=entry_id, place="running", fields=fields)
    return None


def waiting_entry(keys: Keys, job_id: str, queues: list[str]) -> Steps[JobEntry | None]:
    """A queued job's entry among the first WAITING_SCAN of each stream of each queue's jobs
    (protocol.backlog), from each stream's head, not past the last-delivered id: a worker may have
    read the entry and not yet claimed the job."""
    heads: list[tuple[str, str]] = []
    for queue in queues:
        _, streams = yield from read_queue_streams(keys, queue)
        heads += [(queue, s.key) for s in streams]
    found = yield from stream_heads([stream for _, stream in heads], WAITING_SCAN)
    for (queue, _), entries in zip(heads, found):
        for entry_id, fields in entries:
            if fields.get("id") == job_id:
                return JobEntry(queue=queue, entry_id=entry_id, place="waiting", fields=fields)
    return None


def dead_entry(keys: Keys, job_id: str, queues: list[str]) -> Steps[JobEntry | None]:
    """A poison job's newest dead letter, in the first of `queues` that has one."""
    for queue in queues:
        try:
            letter = yield from find_in_any(keys, queue, job_id)
        except DeadLetterNotFound:
            continue
        return JobEntry(queue=queue, entry_id=letter.letter_id, place="dead letter", fields=letter.fields)
    return None


def worker_health(keys: Keys) -> Steps[list[WorkerHealth]]:
    queues = yield from registry.queue_names(keys)
    now, indexes = yield from registry.beat_times(keys, queues)
    named = [(queue, name, seen) for queue, index in zip(queues, indexes) for name, seen in index]
    beats = yield from registry.heartbeats_to_live(keys, [name for _, name, _ in named])
    at = epoch_ms(now) / 1000
    rows = [
        health(queue, name, at - seen, heartbeat, ttl_ms)
        for (queue, name, seen), (heartbeat, ttl_ms) in zip(named, beats)
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
    try:
        info = WorkerInfo.model_validate(heartbeat)
    except ValidationError:
        return WorkerHealth(name=name, queue=queue, condition="unreadable", heartbeat_age_s=max(0.0, age_s), info=None)
    return WorkerHealth(
        name=name, queue=queue, condition="stale" if stale else "live", heartbeat_age_s=max(0.0, age_s), info=info
    )
