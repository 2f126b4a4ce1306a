"""The clients' operations on one job, written once as steps (producer_client.steps): `Client` runs
them over redis-py, `AsyncClient` over redis.asyncio."""

from __future__ import annotations

import time
from collections.abc import Callable

from producer_client.errors import NotReplicated
from producer_client.keys import Keys
from producer_client.new_job import NewJob
from producer_client.protocol import producer as scripts
from producer_client.protocol.replication import Replication
from producer_client.protocol.script import ScriptCall
from producer_client.schema import JobResult, Timings


def enqueue_commands(
    keys: Keys,
    queue: str,
    max_depth: int | None,
    job: NewJob,
    create: bool,
    replication: Replication,
    stream: str | None = None,
) -> Callable:
    """The pipeline that enqueues `job`: CREATE first when `create` (a fresh id cannot collide, so
    creating and enqueueing take one round trip; CREATE sets the status only if there is none, so
    a retried pipeline never sets a started job back to queued), then ENQUEUE, then for a
    request_id's job the `enqueued` flag that tells a later submit with the same request_id that
    the entry exists (no later submit names a fresh id); with a replication to wait for, a WAIT on
    the job's node and one on the queue's (on one server they are the same: the second answers at
    once). `enqueued` reads the replies."""

    def add(pipe) -> None:
        if create:
            job.add_fresh_create(pipe, keys)
        job.enqueue_call(keys, queue, max_depth, stream).add_to(pipe)
        if job.idempotent:
            pipe.hset(keys.job(job.job_id), "enqueued", "1")
        if replication.waits:
            for key in (keys.job(job.job_id), stream or keys.queue(queue)):
                pipe.wait_replicas(key, replication.replicas, replication.timeout_ms)

    return add


def enqueued(job: NewJob, create: bool, replication: Replication, replies: list) -> list:
    """ENQUEUE's reply ({1, entry id} or {0, depth}) among those of `enqueue_commands`. Raises
    NotReplicated for an entry that fewer replicas than asked for have confirmed."""
    added = replies[1 if create else 0]
    if added[0] and replication.waits:
        confirmed = min(replies[-2:])
        if confirmed < replication.replicas:
            raise NotReplicated(job.job_id, confirmed, replication.replicas, replication.timeout_ms)
    return added


def cancel_call(keys: Keys, job_id: str) -> ScriptCall:
    """CANCEL, with the result the job gets if no worker started it yet."""
    result = JobResult(id=job_id, status="cancelled", finish_reason="abort", timings=Timings(finished_at=time.time()))
    return scripts.cancel(keys, job_id, result.model_dump_json())
