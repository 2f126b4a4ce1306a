"""The reads of a job's status, a queue's stats and the live workers, as steps
(producer_client.steps), and how their replies parse."""

from __future__ import annotations

from producer_client.errors import JobNotFound
from producer_client.keys import DEFAULT_LANE, GROUP, NO_TENANT, Keys
from producer_client.protocol.clock import epoch_ms
from producer_client.schema import JobResult, JobStatus, QueueStats, StreamStats, WorkerInfo
from producer_client.steps import Steps, checked


def read_status(keys: Keys, job_id: str) -> Steps[JobStatus]:
    fields, redis_time = checked((yield lambda pipe: (pipe.hgetall(keys.job(job_id)), pipe.time())))
    return job_status(job_id, fields, redis_time)


def job_status(job_id: str, fields: dict[str, str], redis_time: tuple[int, int]) -> JobStatus:
    """From HGETALL of the job's hash and TIME. A queued job past its deadline is `expired`
    already: no worker will start it (the first to read its entry records that)."""
    if not fields:
        raise JobNotFound(job_id)
    result = fields.get("result")
    status = fields["status"]
    deadline_ms = fields.get("deadline")
    if status == "queued" and deadline_ms is not None and epoch_ms(redis_time) > int(deadline_ms):
        status = "expired"
    return JobStatus(
        id=job_id,
        status=status,
        tokens=int(fields.get("tokens", 0)),
        worker=fields.get("worker"),
        cancel_requested=fields.get("cancel") == "1",
        result=None if result is None else JobResult.model_validate_json(result),
    )


def read_queue_stats(keys: Keys, queue: str) -> Steps[QueueStats]:
    """The queue's stats over its own stream and every lane stream it has had, in three round
    trips: the worker index and the set of lane streams; their lengths and the heartbeats; the
    groups of the streams that hold entries."""
    names, members = checked(
        (yield lambda pipe: (pipe.zrange(keys.workers(queue), 0, -1), pipe.smembers(keys.lane_streams(queue))))
    )
    routes = [(DEFAULT_LANE, NO_TENANT), *sorted(tuple(member.split(":", 1)) for member in members)]
    streams = [keys.lane_stream(queue, lane, tenant) for lane, tenant in routes]

    def add(pipe) -> None:
        for stream in streams:
            pipe.xlen(stream)
        for name in names:
            pipe.exists(keys.worker(name))

    replies = checked((yield add))
    depths, alive = replies[: len(streams)], replies[len(streams) :]
    held = [i for i, depth in enumerate(depths) if depth]  # XINFO GROUPS fails on a missing stream
    groups = (
        dict(zip(held, checked((yield lambda pipe: [pipe.xinfo_groups(streams[i]) for i in held])))) if held else {}
    )
    lanes = [stream_stats(lane, tenant, depths[i], groups.get(i, [])) for i, (lane, tenant) in enumerate(routes)]
    base = queue_stats(queue, depths[0], groups.get(0, []), names, alive)
    return base.model_copy(
        update={
            "depth": sum(s.depth for s in lanes),
            "pending": sum(s.pending for s in lanes),
            "waiting": sum(s.waiting for s in lanes),
            "streams": [s for s in lanes if s.depth],
        }
    )


def backlog(depth: int, groups: list[dict]) -> tuple[int, int]:
    """(pending, waiting) of a stream of `depth` entries, from its XINFO GROUPS (empty when it
    has none)."""
    group = next((g for g in groups if g["name"] == GROUP), None)
    pending = group["pending"] if group else 0
    lag = group.get("lag") if group else None
    # Acked entries are deleted, so depth = waiting + pending whenever Redis cannot tell the lag.
    return pending, lag if lag is not None else depth - pending


def stream_stats(lane: str, tenant: str, depth: int, groups: list[dict]) -> StreamStats:
    pending, waiting = backlog(depth, groups)
    return StreamStats(
        lane=lane, tenant=None if tenant == NO_TENANT else tenant, depth=depth, pending=pending, waiting=waiting
    )


def queue_stats(queue: str, depth: int, groups: list[dict], names: list[str], alive: list[int]) -> QueueStats:
    """Of the queue's own stream, from XLEN, XINFO GROUPS (empty when the queue is empty), the
    worker index and EXISTS on each worker's heartbeat key: the heartbeat's TTL runs on the Redis
    clock."""
    pending, waiting = backlog(depth, groups)
    return QueueStats(
        queue=queue,
        depth=depth,
        pending=pending,
        waiting=waiting,
        workers=[n for n, a in zip(names, alive) if a],
    )


def read_live_workers(keys: Keys) -> Steps[list[WorkerInfo]]:
    """Every live worker of every queue, from the queue index, each queue's worker index and the
    heartbeats (an expired heartbeat is a dead worker): which models are served where. On a
    cluster the indexes and heartbeats lie on many shards: each step is one round trip to all of
    them at once."""
    (queues,) = checked((yield lambda pipe: pipe.zrange(keys.queues(), 0, -1)))

    def add_indexes(pipe) -> None:
        for queue in queues:
            pipe.zrange(keys.workers(queue), 0, -1)

    names = [name for index in checked((yield add_indexes)) for name in index]

    def add_heartbeats(pipe) -> None:
        for name in names:
            pipe.hgetall(keys.worker(name))

    return live_workers(checked((yield add_heartbeats)))


def live_workers(heartbeats: list[dict[str, str]]) -> list[WorkerInfo]:
    """The workers whose heartbeat hash still exists (HGETALL of an expired one is empty)."""
    return [WorkerInfo.model_validate(h) for h in heartbeats if h]
