"""What the queues hold right now, for operators (`mili jobs`, `mili workers`, the board), read from
the keys protocol v1 already has, without a scan of the keyspace:

- waiting jobs: the queue's entries past the consumer group's last-delivered id;
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
from producer_client.keys import GROUP, Keys
from producer_client.protocol.clock import entry_age_s, epoch_ms
from producer_client.schema import JobStatus, WorkerInfo
from producer_client.status_reads import queue_stats
from producer_client.steps import Steps, checked
from producer_client.validation import check_limit

GONE_SHOWN = 10  # gone workers listed per queue, the most recent first
WAITING_SCAN = 1000  # entries read from the head of each queue to find a queued job's


class WaitingJob(BaseModel):
    queue: str
    job_id: str
    entry_id: str
    waited_s: float  # since its enqueue
    fields: dict[str, str]  # the entry: id, v, body


class RunningJob(BaseModel):
    queue: str
    job_id: str
    entry_id: str
    worker: str  # the consumer that holds the entry
    deliveries: int
    idle_s: float  # since its worker last refreshed it (every heartbeat) or took it
    tokens: int  # generated so far


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
        """The job's entry, looked for in `queues`: a running job's by its id, a queued job's among
        the first WAITING_SCAN entries of each, a poison job's among the dead letters. None for
        any other job: its entry is deleted once it ends, and its body with it."""
        return self.run(self.client, entry_of(self.keys, status, queues))


def queue_names(keys: Keys) -> Steps[list[str]]:
    (names,) = checked((yield lambda pipe: pipe.zrange(keys.queues(), 0, -1)))
    return names


def overview(keys: Keys, queue: str) -> Steps[QueueOverview]:
    stream = keys.queue(queue)

    def add(pipe) -> None:
        pipe.time()
        pipe.xlen(stream)
        pipe.xlen(keys.dead(queue))
        pipe.xinfo_groups(stream)
        pipe.xinfo_stream(stream)

    now, depth, dead, groups, info = yield add
    checked([now, depth, dead])
    # XINFO fails on a stream that does not exist (no worker has served the queue yet).
    groups, info = (groups, info) if _exists(groups) and _exists(info) else ([], None)
    stats = queue_stats(queue, depth, groups, [], [])
    after = _last_delivered(groups)
    (oldest,) = checked((yield lambda pipe: pipe.xrange(stream, after, "+", count=1)))
    now_ms = epoch_ms(now)
    return QueueOverview(
        queue=queue,
        depth=depth,
        pending=stats.pending,
        waiting=stats.waiting,
        dead=dead,
        oldest_waiting_s=entry_age_s(oldest[0][0], now_ms) if oldest else None,
        processed=None if info is None or "entries-added" not in info else info["entries-added"] - info["length"],
        at=now_ms / 1000,
    )


def waiting(keys: Keys, queue: str, limit: int) -> Steps[list[WaitingJob]]:
    stream = keys.queue(queue)
    now, groups = yield lambda pipe: (pipe.time(), pipe.xinfo_groups(stream))
    checked([now])
    start = _last_delivered(groups if _exists(groups) else [])
    (entries,) = checked((yield lambda pipe: pipe.xrange(stream, start, "+", count=limit)))
    now_ms = epoch_ms(now)
    return [
        WaitingJob(
            queue=queue,
            job_id=fields.get("id", ""),
            entry_id=entry_id,
            waited_s=entry_age_s(entry_id, now_ms),
            fields=fields,
        )
        for entry_id, fields in entries
    ]


def running(keys: Keys, queue: str, limit: int) -> Steps[list[RunningJob]]:
    stream = keys.queue(queue)
    (pending,) = yield lambda pipe: pipe.xpending_range(stream, GROUP, "-", "+", limit)
    if not _exists(pending) or not pending:
        return []

    def add_entries(pipe) -> None:
        for p in pending:
            pipe.xrange(stream, p["message_id"], p["message_id"])

    job_ids = [entries[0][1].get("id", "") if entries else "" for entries in checked((yield add_entries))]

    def add_tokens(pipe) -> None:
        for job_id in job_ids:
            pipe.hget(keys.job(job_id), "tokens")

    tokens = checked((yield add_tokens))
    return [
        RunningJob(
            queue=queue,
            job_id=job_id,
            entry_id=p["message_id"],
            worker=p["consumer"],
            deliveries=p["times_delivered"],
            idle_s=p["time_since_delivered"] / 1000,
            tokens=int(t or 0),
        )
        for p, job_id, t in zip(pending, job_ids, tokens)
    ]


def entry_of(keys: Keys, status: JobStatus, queues: list[str]) -> Steps[JobEntry | None]:
    (entry_id,) = checked((yield lambda pipe: pipe.hget(keys.job(status.id), "entry")))
    if entry_id:

        def add_lookups(pipe) -> None:
            for queue in queues:
                pipe.xrange(keys.queue(queue), entry_id, entry_id)

        for queue, entries in zip(queues, checked((yield add_lookups))):
            if entries and entries[0][1].get("id") == status.id:
                return JobEntry(queue=queue, entry_id=entry_id, place="running", fields=entries[0][1])
    if status.status == "queued":
        # From the stream's head, not past the last-delivered id: a worker may have read the entry
        # and not yet claimed the job.
        def add_heads(pipe) -> None:
            for queue in queues:
                pipe.xrange(keys.queue(queue), "-", "+", count=WAITING_SCAN)

        for queue, entries in zip(queues, checked((yield add_heads))):
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


def _last_delivered(groups: list[dict]) -> str:
    """XRANGE's start for the entries no worker has read yet."""
    group = next((g for g in groups if g["name"] == GROUP), None)
    return "-" if group is None else "(" + group["last-delivered-id"]


def _exists(reply: object) -> bool:
    """False for the error XINFO and XPENDING give on a key that does not exist; other errors raise."""
    if isinstance(reply, Exception):
        if "no such key" in str(reply).lower() or "nogroup" in str(reply).lower():
            return False
        raise reply
    return True
