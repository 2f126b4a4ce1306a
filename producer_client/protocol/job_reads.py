"""Reads of a job's keys: its hash `mili:job:{id}`, read for its status, its end and operators'
views; its `done` stream, which a waiting reader blocks on; its event stream, which a reader of
stream() and a worker that resumes the job read. The scripts of protocol.producer and
protocol.worker write them: the hash's `status`, `tokens` generated so far, the `worker` running
it, the `entry` reference of the queue entry it was claimed from (protocol.backlog.entry_stream),
its `result`... Each read is an `add_*` function that adds its commands to a pipeline (the caller
says whether the step is Repeatable, and reads the replies as each function says), or a Steps
(producer_client.steps) where a read is a step of its own."""

from __future__ import annotations

from collections.abc import Iterable

from producer_client.keys import Keys
from producer_client.protocol.clock import RedisTime
from producer_client.protocol.execution import Pipe
from producer_client.steps import Repeatable, Steps, checked

# The reply of add_look's HMGET: the job's status, deadline (epoch ms on
# Redis's clock) and result JSON, each None where the hash has none.
JobLook = tuple[str | None, str | None, str | None]
StatusAndDeadline = tuple[str | None, str | None]  # see JobLook
Entry = tuple[str, dict[str, str]]  # a stream entry: its id and fields
# An XREAD's reply: each stream that had entries, with them; None when none came within its block.
StreamsReply = list[tuple[str, list[Entry]]] | None


def add_job_fields(pipe: Pipe, keys: Keys, job_id: str) -> None:
    """The job's hash (HGETALL: {} for no such job), then Redis's clock (TIME)."""
    pipe.hgetall(keys.job(job_id))
    pipe.time()


def job_fields(keys: Keys, job_id: str) -> Steps[tuple[dict[str, str], RedisTime]]:
    """The job's hash ({}: no such job) and Redis's clock (TIME) as it was read: one round trip."""
    fields, redis_time = checked((yield lambda pipe: add_job_fields(pipe, keys, job_id)))
    return fields, redis_time


def field_of_jobs(keys: Keys, job_ids: list[str], field: str) -> Steps[list[str | None]]:
    """One field of each job's hash (None where it has none, or there is no such job)."""
    return checked((yield from fields_of_jobs(keys, job_ids, field)))


def fields_of_jobs(keys: Keys, job_ids: list[str], field: str) -> Steps[list[str | None | Exception]]:
    """field_of_jobs, with each job's error in its place (a hash of another type)."""
    if not job_ids:
        return []
    return (yield lambda pipe: [pipe.hget(keys.job(job_id), field) for job_id in job_ids])


def add_done_types(pipe: Pipe, done_streams: Iterable[str]) -> None:
    """XLEN of each of jobs' `done` streams: a WRONGTYPE error in the place of one of another
    type, which fails an XREAD of them all (a producer's ACL has no TYPE)."""
    for done in done_streams:
        pipe.xlen(done)


def add_look(pipe: Pipe, keys: Keys, job_id: str) -> None:
    """The job's status, deadline and result (one HMGET: a JobLook), then Redis's clock (TIME), for
    waiting.expiry."""
    pipe.hmget(keys.job(job_id), "status", "deadline", "result")
    pipe.time()


def look(keys: Keys, job_id: str) -> Steps[tuple[JobLook, RedisTime]]:
    """add_look as a step of its own (Repeatable)."""
    (status, deadline_ms, result), redis_time = checked((yield Repeatable(lambda pipe: add_look(pipe, keys, job_id))))
    return (status, deadline_ms, result), redis_time


def deadlines(keys: Keys, job_ids: list[str]) -> Steps[tuple[list[StatusAndDeadline | Exception], RedisTime]]:
    """Each job's status and deadline (an HMGET each), or its error in its place (a hash of
    another type), then Redis's clock (TIME): one round trip."""

    def add(pipe: Pipe) -> None:
        for job_id in job_ids:
            pipe.hmget(keys.job(job_id), "status", "deadline")
        pipe.time()

    *fields, redis_time = yield add
    if isinstance(redis_time, Exception):
        raise redis_time
    return [f if isinstance(f, Exception) else (f[0], f[1]) for f in fields], redis_time


def add_ends_read(pipe: Pipe, done_streams: Iterable[str], block_ms: int) -> None:
    """One XREAD of jobs' `done` streams (Keys.done of each), from their start, one entry each: it
    returns at once with every one that has its entry, else blocks up to `block_ms` for the first.
    Its reply: [(done stream key, [(entry id, {"data": result JSON})]) ...], None when none came."""
    pipe.xread(dict.fromkeys(done_streams, "0-0"), count=1, block=block_ms)


def end_read(
    keys: Keys, job_id: str, block_ms: int, with_result: bool = True
) -> Steps[tuple[StreamsReply | Exception, str | None | Exception]]:
    """add_ends_read of the one job, then (`with_result`) its hash's result (HGET), in one round
    trip (Repeatable): a job that ended before the read began, longer ago than its done stream
    lives, is found there. Each reply, or the error in its place; None for the result not read."""
    done, job = keys.done(job_id), keys.job(job_id)

    def add(pipe: Pipe) -> None:
        add_ends_read(pipe, (done,), block_ms)
        if with_result:
            pipe.hget(job, "result")

    reply, *result = yield Repeatable(add)
    return reply, result[0] if result else None


def add_events_kept(pipe: Pipe, keys: Keys, job_id: str) -> None:
    """Whether the job's event stream exists (EXISTS: 1 or 0): an ended job keeps it only where
    someone streams it or more than one run published to it (protocol.script.END_JOB)."""
    pipe.exists(keys.events(job_id))


def add_last_event(pipe: Pipe, keys: Keys, job_id: str) -> None:
    """The job's last event (XREVRANGE + - COUNT 1): [(its id, its fields)], or [] for none."""
    pipe.xrevrange(keys.events(job_id), count=1)


def events_read(
    keys: Keys, job_id: str, after: str, count: int, block_ms: int | None
) -> Steps[StreamsReply | Exception]:
    """One XREAD of up to `count` of the job's events after the id `after`, blocking up to
    `block_ms` (None: not blocking) (Repeatable): [(events key, [(event id, {"type": ..., "data": ...}) ...])], None
    when none came, or the error in its place."""
    key = keys.events(job_id)
    reply: StreamsReply | Exception
    (reply,) = yield Repeatable(lambda pipe: pipe.xread({key: after}, count=count, block=block_ms))
    return reply


def add_events_page(pipe: Pipe, keys: Keys, job_id: str, start: str, count: int) -> None:
    """Up to `count` of the job's events from the id `start` on (XRANGE; "(" before an id excludes
    it), for a worker that resumes the job: [(event id, fields) ...]."""
    pipe.xrange(keys.events(job_id), start, "+", count=count)


def add_run_flags(pipe: Pipe, keys: Keys, job_id: str) -> None:
    """A running job's cancel flag, run token and streamed flag (one HMGET), which the worker
    running it looks at (replies.parse_watch)."""
    pipe.hmget(keys.job(job_id), "cancel", "run", "streamed")
