"""The clients' operations on one job, written once as steps (producer_client.steps): `Client` runs
them over redis-py, `AsyncClient` over redis.asyncio, and each checks its arguments before its
first command. Their many-job twins are in producer_client.bulk, a job's event stream in
producer_client.job_stream."""

from __future__ import annotations

import time
from typing import NamedTuple

from redis.exceptions import NoPermissionError

from producer_client.client_base import ClientBase
from producer_client.cluster import is_cluster
from producer_client.connection import is_other_type
from producer_client.errors import JobNotFound, JobTimeout, NotReplicated, RedisUnavailable
from producer_client.keys import NO_TENANT, Keys
from producer_client.new_job import NewJob
from producer_client.protocol import job_reads
from producer_client.protocol import producer as scripts
from producer_client.protocol.execution import AddCommands, Pipe, Replies
from producer_client.protocol.producer import NO_LIMITS, Limits
from producer_client.protocol.replication import Replication
from producer_client.protocol.replies import Enqueued, Refusal, parse_enqueue
from producer_client.protocol.script import ScriptCall
from producer_client.rate_limits import NO_RATE_LIMITS, RateLimits
from producer_client.schema import JobResult, JobStatus, Timings
from producer_client.sharing import (
    Submitted,
    enqueue_call,
    rate_limits_of,
    refusal_error,
    refuse_queue_stream_of_another_type,
    reserve_call,
)
from producer_client.status_reads import read_status
from producer_client.steps import Repeatable, Steps, checked, undoing
from producer_client.validation import check_job_id, check_timeout
from producer_client.waiting import (
    NOTHING_KNOWN,
    Deadline,
    Known,
    end_read_of,
    finished,
    unended_expiry,
    wait_done,
)


def submit(client: ClientBase, job: NewJob) -> Steps[str]:
    """Enqueue `job` on the client's queue, in its lane of the client's tenant, with its settings
    (bound, limits, replication, placement); returns its id."""
    try:
        job_id, _, _ = yield from submit_reading(client, job, None)
    except RedisUnavailable as e:  # here, not in a generator around it: a submit's Python calls count
        raise e.of_job(job.job_id) from e.__cause__
    return job_id


def submit_rated(client: ClientBase, job: NewJob) -> Steps[Submitted]:
    """submit(), with the tenant's rate limits after it. A job whose request_id CREATE finds
    already is not enqueued again; one on an adapter no live worker of the queue serves is refused
    first (UnknownAdapter), and so is a shard count other than the queue's (ShardCountMismatch). A
    refusal (the stream's bound, the tenant's waiting quota or a rate limit) removes the job's hash
    again and raises."""
    try:
        job_id, limits, _ = yield from submit_reading(client, job, None)
    except RedisUnavailable as e:
        raise e.of_job(job.job_id) from e.__cause__
    return Submitted(job_id, limits)


def submit_reading(
    client: ClientBase, job: NewJob, read: Deadline | None
) -> Steps[tuple[str, RateLimits, FirstRead | None]]:
    """submit_rated()'s job id and rate limits, as a tuple: no Submitted made at every submit (a
    frozen dataclass, some 6k instructions to make). With `read`, the job's first blocking read of its
    `done` stream under that deadline goes in the enqueue's round trip where first_read_block
    allows it: what it read, or None where it was not sent."""
    if client.shards.spreads:
        yield from client.shards.agree(client.keys, client.queue)
    if job.adapter is not None:
        yield from client.placement.check_adapters(client.keys, client.queue, [job.adapter])
    first = None
    if job.idempotent:
        (reply,) = checked((yield job.create_call(client.keys).add_to))
        if not job.created(reply):
            return job.job_id, NO_RATE_LIMITS, None
        outcome, _ = yield from enqueue_or_forget(client, job, create=False)
    else:
        # A fresh id cannot collide: create the job and enqueue it in one round trip.
        outcome, first = yield from enqueue_or_forget(client, job, create=True, read=read)
    error = refusal_error(outcome, client.queue, client.tenant_name, client.max_queue_depth)
    if error is not None:
        yield from undoing(forget(client.keys, job), error)
        raise error
    if not job.idempotent:
        client.submissions.add(job.job_id, expiry_of_new(job))
    return job.job_id, rate_limits_of(outcome), first


class FirstRead(NamedTuple):
    """The first blocking read of a job's `done` stream, sent in its enqueue's round trip: the
    job's end (result JSON; None: it did not end within the read's block), and when the round
    trip was sent (monotonic), a moment the job had not ended at."""

    end: str | None
    sent_at: float


def enqueue_or_forget(
    client: ClientBase,
    job: NewJob,
    create: bool,
    read: Deadline | None = None,
    place: bool = True,
    counted: bool = False,
) -> Steps[tuple[Enqueued, FirstRead | None]]:
    """The enqueue's outcome, and with `read` the job's first read of its `done` stream where
    first_read_block lets it ride in the enqueue's round trip (None where it did not). If the
    enqueue fails, or is stopped on its way (a KeyboardInterrupt,
    an asyncio task's cancel: the drivers raise those in here too), the job hash goes, so that a
    later submit with the same request_id enqueues the job instead of finding one that will never
    run, and no hash of a job that was never taken stays behind. An enqueued job too few replicas
    confirmed stays: it runs (NotReplicated). A job placed on a worker's own stream, of a tenant
    with limits, is counted against them first (a reservation in the queue's slot: the worker's
    stream may lie on another shard). On a queue of several shards the job goes to its id's, but
    for a tenant with limits: shard 0, where its limits are counted as one. `place` False: the
    shared route; `counted`: the tenant's limits counted the job already (placed_elsewhere)."""
    keys, queue, tenant = client.keys, client.queue, client.tenant_name
    # Neither a placement nor a quota to read (a queue of one worker or none, a client without a
    # tenant): answered without their generators, a few thousand instructions of every such submit.
    if not place or client.placement.shared_now(queue, 1):
        stream = None
    else:
        (stream,) = yield from client.placement.streams_for(keys, queue, [job.prefix])
    limits = NO_LIMITS if client.tenant is None else (yield from client.quota_cache.limits_for(keys, client.tenant))
    if counted:
        limits = Limits(weight=limits.weight)
    if client.shards.spreads and not limits.any:
        queue = client.shards.name_for(queue, job.job_id)
    block_ms = None if read is None else first_read_block(client, job, create, stream, limits, read)
    replies: Replies = []
    try:
        reserved = None
        if stream is not None and limits.any:
            reserved = parse_enqueue(checked((yield reserve_call(keys, queue, tenant, [job], limits).add_to))[0])
            if reserved.refusal is not Refusal.NONE:
                return reserved, None
        add = enqueue_commands(
            keys, queue, client.max_queue_depth, job, create, client.replication, stream, tenant, limits
        )
        sent_at = time.monotonic()
        replies = yield (add if block_ms is None else with_end_read(add, keys.done(job.job_id), block_ms))
        read_reply = replies.pop() if block_ms is not None else None
        if stream is None:
            refuse_queue_stream_of_another_type(replies[1 if create else 0], client.queue, [job], tenant)
        elif is_other_type(replies[1 if create else 0]):
            return (yield from placed_elsewhere(client, job, reserved is not None))
        checked(replies)
    except GeneratorExit:
        raise  # closed unfinished: its driver was stopped after the enqueue ran, so nothing to undo
    except BaseException as stopped:
        if not (create and replies and isinstance(replies[0], NoPermissionError)):
            yield from undoing(forget(keys, job), stopped)
        # else the ACL refused the CREATE its job's hash: it wrote nothing there, and would refuse
        # the DEL too, whose refusal was logged as a clean-up that failed (a second line from mili)
        raise
    outcome = enqueued(job, create, client.replication, replies)
    first = None if block_ms is None else FirstRead(end_read_of(read_reply), sent_at)
    return (reserved if reserved is not None else outcome), first


def placed_elsewhere(client: ClientBase, job: NewJob, reserved: bool) -> Steps[tuple[Enqueued, FirstRead | None]]:
    """The job whose placed XADD met its worker's stream of another type (a producer may write it:
    docs/security.md), enqueued on the shared route instead, where any worker takes it: the
    worker's next READ makes its stream anew, and the view that chose it is read again first. Its
    hash is there already (the first round trip created it). A tenant's limits counted the job
    already where it was `reserved`: the shared route counts it no more."""
    client.placement.forget_view(client.queue)
    return (yield from enqueue_or_forget(client, job, create=False, place=False, counted=reserved))


def first_read_block(
    client: ClientBase, job: NewJob, create: bool, stream: str | None, limits: Limits, read: Deadline
) -> int | None:
    """The block (ms) of the job's first read of its `done` stream under `read`, where that read
    may go in the round trip of the job's enqueue; None where it may not. The read blocks the
    connection, and Redis runs a pipeline's commands in order, so it may follow the enqueue only
    where nothing the client checks for can refuse the enqueue (a refused job would never end; a
    refusal all the same, a stream of another type or an ACL's, drops the read: with_end_read): a fresh job (a request_id's may exist already) placed on a worker's
    own stream or sent to a queue without a bound, of a tenant without limits, with no replication
    to wait for (NotReplicated is the submit's answer). And only for a job without a deadline
    (timeout_s): for one with a deadline, the caller's timeout would count from before the job's
    CREATE, so a caller whose timeout is the job's own could reach its end before the job's
    deadline by Redis's clock (JobTimeout, where a wait after the submit answers JobExpired). On
    one server only: a cluster
    splits the pipeline per node, and the job's `done` stream may lie on another node than the
    stream its entry goes to."""
    if not create or job.timeout_ms or limits.any or client.replication.waits or is_cluster(client.redis):
        return None
    if stream is None and client.max_queue_depth is not None:
        return None
    try:
        return read.block_ms()
    except JobTimeout:
        return None  # the caller's time is up already: the submit goes alone, and the wait says so


def with_end_read(add: AddCommands, done: str, block_ms: int) -> AddCommands:
    """`add`'s commands, then one blocking XREAD of the job's `done` stream (its reply last: None where
    a command before it was refused)."""

    def both(pipe: Pipe) -> None:
        add(pipe)
        # Read only where nothing before it was refused (a placed XADD's WRONGTYPE, an ACL's NOPERM,
        # a lost script): else it would wait out its block for a job never enqueued.
        pipe.last_unless_refused(lambda commands: job_reads.add_ends_read(commands, (done,), block_ms))

    return both


def forget(keys: Keys, job: NewJob) -> AddCommands:
    return Repeatable(lambda pipe: scripts.add_forget(pipe, keys, [job.job_id]))


def enqueue_commands(
    keys: Keys,
    queue: str,
    max_depth: int | None,
    job: NewJob,
    create: bool,
    replication: Replication,
    stream: str | None = None,
    tenant: str = NO_TENANT,
    limits: Limits = NO_LIMITS,
) -> AddCommands:
    """The pipeline that enqueues `job`: CREATE first when `create` (a fresh id cannot collide, so
    creating and enqueueing take one round trip; CREATE sets the status only if there is none, so
    a retried pipeline never sets a started job back to queued), then the enqueue (sharing.
    enqueue_call), then for a request_id's job the `enqueued` flag that tells a later submit with
    the same request_id that the entry exists (no later submit names a fresh id); with a
    replication to wait for, a WAIT on the job's node and one on the queue's (on one server they
    are the same: the second answers at once). `enqueued` reads the replies."""

    def add(pipe: Pipe) -> None:
        if create:
            scripts.add_fresh_create(pipe, keys, job.job_id, job.timeout_ms)
        enqueue_call(keys, queue, tenant, job, max_depth, limits, stream).add_to(pipe)
        if job.idempotent:
            scripts.add_enqueued_flag(pipe, keys, job.job_id)
        if replication.waits:
            for key in (keys.job(job.job_id), stream or keys.queue(queue)):
                pipe.wait_replicas(key, replication.replicas, replication.timeout_ms)

    return add


def enqueued(job: NewJob, create: bool, replication: Replication, replies: Replies) -> Enqueued:
    """The enqueue's outcome among the replies of `enqueue_commands`. Raises NotReplicated for an
    entry that fewer replicas than asked for have confirmed."""
    outcome = parse_enqueue(replies[1 if create else 0])
    if outcome.added and replication.waits:
        confirmed = min(replies[-2:])
        if confirmed < replication.replicas:
            raise NotReplicated(job.job_id, confirmed, replication.replicas, replication.timeout_ms)
    return outcome


def cancel_call(keys: Keys, job_id: str) -> ScriptCall:
    """CANCEL, with the result the job gets if no worker started it yet."""
    result = JobResult(id=job_id, status="cancelled", finish_reason="abort", timings=Timings(finished_at=time.time()))
    return scripts.cancel(keys, job_id, result.model_dump_json())


def result(keys: Keys, job_id: str, timeout: float | None) -> Steps[JobResult]:
    """Client.result: the job's result, from its hash if it has ended, else from its `done` stream;
    JobExpired as soon as a job still queued passes its deadline."""
    job_id = check_job_id(job_id)
    deadline = Deadline(job_id, check_timeout(timeout))
    job, redis_time = checked((yield Repeatable(lambda pipe: job_reads.add_job_fields(pipe, keys, job_id))))
    if not job:
        raise JobNotFound(job_id)
    if "result" in job:
        return finished(job_id, job["result"])
    expires_at = unended_expiry(job_id, job.get("status", ""), job.get("deadline"), redis_time)
    return finished(job_id, (yield from wait_done(keys, job_id, deadline, expires_at)))


def wait(keys: Keys, job_id: str, timeout: float | None, known: Known = NOTHING_KNOWN) -> Steps[JobResult]:
    """Client.wait: result() without looking the job up first (its first look at the `done`
    stream reads the job's deadline too). `known`: what the client knows of the job from its
    submit (Submissions): then its first read is the blocking one, without the job's hash."""
    job_id = check_job_id(job_id)
    deadline = Deadline(job_id, check_timeout(timeout))
    return finished(job_id, (yield from wait_done(keys, job_id, deadline, *known)))


def generate(client: ClientBase, job: NewJob, timeout: float | None) -> Steps[JobResult]:
    """Client.generate: submit() of `job` (built of its keyword arguments), then wait(). Where
    first_read_block allows it, the wait's first blocking read goes in the enqueue's round trip,
    and the caller's timeout counts from its sending: a job that ends within that block costs one
    round trip. Elsewhere the timeout counts from the submit's end, as a wait()'s after a submit.
    A job just created expires timeout_s from now at the latest; one found by its request_id may be
    older."""
    timeout = check_timeout(timeout)
    deadline = Deadline(job.job_id, timeout)
    try:
        job_id, _, first = yield from submit_reading(client, job, deadline)
        known = client.submissions.known(job_id)
        if first is None:
            deadline = Deadline(job_id, timeout)
        elif first.end is not None:
            return finished(job_id, first.end)
        else:
            known = Known(known.expires_at, first.sent_at)  # its submit's moment, before the read blocked
        return finished(job_id, (yield from wait_done(client.keys, job_id, deadline, *known)))
    except RedisUnavailable as e:
        raise e.of_job(job.job_id) from e.__cause__


def expiry_of_new(job: NewJob) -> float | None:
    """When a job just created with a fresh id expires unread (monotonic), late rather than early:
    its deadline counts from its CREATE, before now."""
    return time.monotonic() + job.timeout_ms / 1000 if job.timeout_ms else None


def status(keys: Keys, job_id: str) -> Steps[JobStatus]:
    return (yield from read_status(keys, check_job_id(job_id)))


def cancel(keys: Keys, job_id: str) -> Steps[JobStatus]:
    """Client.cancel: CANCEL, then the job's status."""
    job_id = check_job_id(job_id)
    (found,) = checked((yield cancel_call(keys, job_id).add_to))
    if found is None:
        raise JobNotFound(job_id)
    return (yield from read_status(keys, job_id))
