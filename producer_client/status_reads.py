"""The reads of a job's status, a queue's stats and the live workers, as steps
(producer_client.steps), and how their replies parse."""

from __future__ import annotations

import logging

import redis
from pydantic import ValidationError

from producer_client.connection import reply_code
from producer_client.errors import InvalidJob, JobNotFound, RedisUnavailable
from producer_client.keys import Keys
from producer_client.protocol import registry
from producer_client.protocol.backlog import read_backlogs, read_queue_streams
from producer_client.protocol.clock import us_left
from producer_client.protocol.job_reads import job_fields
from producer_client.schema import JobResult, JobStatus, QueueStats, WorkerInfo
from producer_client.steps import Steps, T

log = logging.getLogger(__name__)


def of_job(job_id: str, steps: Steps[T]) -> Steps[T]:
    """`steps`, an operation on the one job `job_id` (its status, result, events, cancel), where a
    key of the job holding another type (a WRONGTYPE reply: someone wrote a string at its hash or
    a stream key) raises InvalidJob: an error of that job alone, which asking again will not mend,
    not a Redis failure (which a caller retries, and the gateway answers 503), whose
    RedisUnavailable names the job (RedisUnavailable.of_job)."""
    try:
        return (yield from steps)
    except RedisUnavailable as e:
        raise e.of_job(job_id) from e.__cause__
    except redis.ResponseError as e:
        if reply_code(e) == "WRONGTYPE":
            raise InvalidJob(job_id, "a key of it holds a value of another type than its own") from None
        raise


def read_status(keys: Keys, job_id: str) -> Steps[JobStatus]:
    fields, redis_time = yield from job_fields(keys, job_id)
    return job_status(job_id, fields, redis_time)


def job_status(job_id: str, fields: dict[str, str], redis_time: tuple[int, int]) -> JobStatus:
    """From HGETALL of the job's hash and TIME. A queued job past its deadline is `expired`
    already: no worker will start it (the first to read its entry records that)."""
    if not fields:
        raise JobNotFound(job_id)
    try:
        return parsed_status(job_id, fields, redis_time)
    except (ValueError, KeyError):  # pydantic's ValidationError is a ValueError
        raise InvalidJob(job_id, "its hash's status, tokens, deadline or result do not parse") from None


def parsed_status(job_id: str, fields: dict[str, str], redis_time: tuple[int, int]) -> JobStatus:
    result = None if "result" not in fields else JobResult.model_validate_json(fields["result"])
    status = fields["status"]
    deadline_ms = fields.get("deadline")
    if status == "queued" and deadline_ms is not None and us_left(int(deadline_ms), redis_time) < 0:
        status = "expired"
    return JobStatus(
        id=job_id,
        status=status,
        tokens=int(fields.get("tokens", 0)),
        # An ended job's hash keeps no `worker` (protocol v2): its result names the one that ended it.
        worker=fields.get("worker") or (result.worker if result else None),
        cancel_requested=fields.get("cancel") == "1",
        result=result,
    )


def read_queue_stats(keys: Keys, queue: str) -> Steps[QueueStats]:
    """The queue's stats over every stream of its jobs (protocol.backlog): the queue's own, each
    lane's of each tenant and each worker's own. Four round trips: the worker index and the set of
    lane streams; the streams' lengths; the groups of those that hold entries; each worker's
    heartbeat (registry.alive), whose TTL runs on the Redis clock."""
    names, streams = yield from read_queue_streams(keys, queue)
    found = yield from read_backlogs(streams)
    alive = yield from registry.alive(keys, names)
    return QueueStats(
        queue=queue,
        depth=sum(s.depth for s in found),
        pending=sum(s.pending for s in found),
        waiting=sum(s.waiting for s in found),
        workers=[n for n, a in zip(names, alive) if a],
        streams=[s for s in found if s.depth],
    )


def read_live_workers(keys: Keys) -> Steps[list[WorkerInfo]]:
    """Every live worker of every queue, from the queue index, each queue's worker index and the
    heartbeats (an expired heartbeat is a dead worker): which models are served where. On a
    cluster the indexes and heartbeats lie on many shards: each step is one round trip to all of
    them at once."""
    queues = yield from registry.queue_names(keys)
    indexes = yield from registry.worker_names(keys, queues)
    heartbeats = yield from registry.heartbeats(keys, [name for index in indexes for name in index])
    return live_workers(heartbeats)


def live_workers(heartbeats: list[dict[str, str]]) -> list[WorkerInfo]:
    """The workers whose heartbeat hash still exists (HGETALL of an expired one is empty). One
    that does not parse (a worker of another version, during an upgrade) is left out, with a
    warning: the others are every gateway's model table, which one such hash must not stop."""
    workers = []
    for heartbeat in (h for h in heartbeats if h):
        try:
            workers.append(WorkerInfo.model_validate(heartbeat))
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(map(str, first["loc"]))
            log.warning("worker %r: its heartbeat's %s: %s; left out", heartbeat.get("name"), where, first["msg"])
    return workers
