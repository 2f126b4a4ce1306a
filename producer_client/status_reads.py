"""The reads of a job's status, a queue's stats and the live workers, as steps
(producer_client.steps), and how their replies parse."""

from __future__ import annotations

from producer_client.errors import JobNotFound
from producer_client.keys import GROUP, Keys
from producer_client.protocol.clock import epoch_ms
from producer_client.schema import JobResult, JobStatus, QueueStats, WorkerInfo
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
    stream = keys.queue(queue)
    depth, names = checked((yield lambda pipe: (pipe.xlen(stream), pipe.zrange(keys.workers(queue), 0, -1))))

    def add(pipe) -> None:
        # XINFO GROUPS fails on a stream that does not exist; an empty one has nothing to say.
        if depth:
            pipe.xinfo_groups(stream)
        for name in names:
            pipe.exists(keys.worker(name))

    replies = checked((yield add))
    groups = replies.pop(0) if depth else []
    return queue_stats(queue, depth, groups, names, replies)


def queue_stats(queue: str, depth: int, groups: list[dict], names: list[str], alive: list[int]) -> QueueStats:
    """From XLEN, XINFO GROUPS (empty when the queue is empty), the worker index and EXISTS
    on each worker's heartbeat key: the heartbeat's TTL runs on the Redis clock."""
    group = next((g for g in groups if g["name"] == GROUP), None)
    pending = group["pending"] if group else 0
    lag = group.get("lag") if group else None
    # Acked entries are deleted, so depth = waiting + pending whenever Redis cannot tell the lag.
    waiting = lag if lag is not None else depth - pending
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
