"""How a client waits on a job's streams: a caller's timeout as a series of bounded blocking
reads (Deadline), each one XREAD as a step (producer_client.steps), a read that Redis cut short,
the deadline of a job still queued (JobExpired as soon as it passes: no worker will start it),
and the end waited for (a result, JobFailed or JobExpired). A job's result is in its hash from its
end on; its `done` stream, which a blocking read wakes on, lives only DONE_TTL_MS after the end
(producer_client/keys.py), so a blocking read is followed by a look at the hash, but where the
job is known not to have ended within half that life before the read (Submissions.KEPT_S)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from producer_client.connection import reply_code
from producer_client.errors import InvalidJob, JobTimeout
from producer_client.keys import DONE_TTL_MS, Keys
from producer_client.protocol import job_reads
from producer_client.protocol.clock import us_left
from producer_client.protocol.job_reads import Entry, StreamsReply
from producer_client.schema import JobExpired, JobFailed, JobResult, parse_result
from producer_client.steps import Steps

T = TypeVar("T")

MAX_BLOCK_MS = 2000  # one blocking read, well inside redis-py's default 5 s socket timeout
# The statuses of a job that has not ended. Every end writes the job's status and its result at
# once (protocol.script's end_job), so a look that finds another status and no result has met a
# hash no worker wrote (a producer may write it): without this a wait on it never ended.
UNENDED = frozenset({"queued", "running"})
UNPARSED = "its hash holds a status or a deadline the protocol does not define"


class Deadline:
    """Turns a caller's timeout into XREAD BLOCK milliseconds, one bounded read at a time:
    redis-py gives up on a socket silent for its socket_timeout (5 s by default), so a long
    wait is a series of blocking reads of at most MAX_BLOCK_MS each. Raises JobTimeout
    when the caller's time is up."""

    def __init__(self, job_id: str, timeout: float | None):
        self.job_id = job_id
        self.timeout = timeout
        self.at = None if timeout is None else time.monotonic() + timeout

    def block_ms(self, until: float | None = None) -> int:
        """The next read's block: to the caller's deadline, and no later than `until` (monotonic)."""
        if self.at is None and until is None:
            return MAX_BLOCK_MS
        now = time.monotonic()
        if self.timeout is not None and self.at is not None and self.at <= now:
            raise JobTimeout(self.job_id, self.timeout)
        left = min(at for at in (self.at, until) if at is not None) - now
        return max(1, min(MAX_BLOCK_MS, int(left * 1000)))  # BLOCK 0 would wait for ever


UNKNOWN = -1.0  # wait_done's expires_at when the job's deadline is yet to be read


class Known(NamedTuple):
    """What a client knows of a job before it waits on it: when it expires unread (monotonic; None:
    it cannot; UNKNOWN: to be read first), and a moment (monotonic) it had not ended at (None: no
    such moment known)."""

    expires_at: float | None = UNKNOWN
    unended_at: float | None = None


NOTHING_KNOWN = Known()


class Submissions:
    """When each job this client submitted with a fresh id expires unread (monotonic; None: it
    cannot), for `wait`, which then need not look the job up before its first blocking read (a
    round trip and two commands less per job: bench/RESULTS.md, "Redis CPU per job"). Kept for
    half of DONE_TTL_MS from the submit: a job ends after its submit, and its done stream lives
    DONE_TTL_MS from its end, so a wait within that time finds the done entry of a job that has
    ended, and blocks only for one that has not. Two generations of at most that age each, so that
    what is kept stays bounded by the submits of DONE_TTL_MS, with no scan; each step a dict's or
    an attribute's, safe across a client's threads."""

    KEPT_S = DONE_TTL_MS / 2000

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.current: dict[str, tuple[float, float | None]] = {}
        self.previous: dict[str, tuple[float, float | None]] = {}
        self.since = clock()

    def add(self, job_id: str, expires_at: float | None) -> None:
        now = self.clock()
        if now - self.since >= self.KEPT_S:
            self.previous, self.current, self.since = self.current, {}, now
        self.current[job_id] = (now, expires_at)

    def known(self, job_id: str) -> Known:
        """The job's expires_at as its submit knew it, and its submit as a moment it had not ended
        at, once (a later wait looks the job up); NOTHING_KNOWN for a job this client did not
        submit, or submitted more than KEPT_S ago."""
        kept = self.current.pop(job_id, None) or self.previous.pop(job_id, None)
        if kept is None or self.clock() - kept[0] >= self.KEPT_S:
            return NOTHING_KNOWN
        return Known(kept[1], kept[0])


def wait_done(
    keys: Keys, job_id: str, deadline: Deadline, expires_at: float | None = UNKNOWN, unended_at: float | None = None
) -> Steps[str]:
    """The job's result JSON: there at once if the job has ended, else from its `done` stream when
    it does. A job still queued when its deadline passes raises JobExpired then, not at the
    caller's timeout. `expires_at`: when the job's deadline passes (monotonic), None if it cannot
    expire unread; UNKNOWN: read it with a first look at the job that does not block.
    `unended_at`: a moment (monotonic) the job had not ended at, if known (Known). A look or a read
    that finds no end is one too, taken before it was sent: the job's end, if any, came after it."""
    if expires_at == UNKNOWN:
        unended_at = time.monotonic()
        (status, deadline_ms, result), redis_time = yield from job_reads.look(keys, job_id)
        if result is not None:
            return result
        expires_at = unended_expiry(job_id, status, deadline_ms, redis_time)
    while True:
        if expires_at is not None and time.monotonic() >= expires_at:
            unended_at = time.monotonic()
            (status, deadline_ms, result), redis_time = yield from job_reads.look(keys, job_id)
            if result is not None:
                return result
            expires_at = unended_expiry(job_id, status, deadline_ms, redis_time)
        sent_at = time.monotonic()
        read = read_done(keys, job_id, deadline, expires_at, ends_kept(unended_at, sent_at))
        result = yield from unless_expired(keys, job_id, expires_at, read)
        if result is not None:
            return result
        unended_at = sent_at


def ends_kept(unended_at: float | None, now: float) -> bool:
    """Whether the job's `done` stream holds its end now if it has ended: the job had not ended at
    `unended_at`, less than KEPT_S ago, half as long as the stream lives after the end (the other
    half: the margin for a moment taken a round trip late, a submit's)."""
    return unended_at is not None and now - unended_at < Submissions.KEPT_S


def read_done(
    keys: Keys, job_id: str, deadline: Deadline, until: float | None, end_in_stream: bool = False
) -> Steps[str | None]:
    """One blocking XREAD of the job's `done` stream, then the hash's result: the result JSON, or
    None if the job did not end within the deadline's next block (ending by `until`). The hash is
    read after the XREAD, in the same round trip: a job that ended before the read began, longer
    ago than its done stream lives, is found there (the read then blocked for nothing, once). With
    `end_in_stream` (the stream holds the job's end if it has ended: wait_done) it is not read."""
    block_ms = deadline.block_ms(until)
    reply, result = yield from job_reads.end_read(keys, job_id, block_ms, with_result=not end_in_stream)
    end = end_read_of(reply)
    if end is not None:
        return end
    if isinstance(result, Exception):
        raise result
    return result


def end_read_of(reply: StreamsReply | Exception) -> str | None:
    """The job's end (result JSON) in the reply of an XREAD of its `done` stream alone; None if
    none came within the read's block (or Redis cut it short: see streams_read)."""
    streams = streams_read(reply)
    if not streams:
        return None
    return streams[0][1][0][1].get("data", "")  # an entry without one: parse_result's invalid_job


def unless_expired(keys: Keys, job_id: str, expires_at: float | None, read: Steps[T]) -> Steps[T]:
    """`read`, a read of the job's streams under a Deadline. When the caller's time is up
    (JobTimeout) and the job could still expire unread (`expires_at`), it is looked up once more:
    JobExpired if it has passed its deadline by Redis's clock. A caller whose timeout is the job's
    own (the gateway's) reaches both ends within a few milliseconds, in either order on this
    process's clock: the job's end is the answer."""
    try:
        return (yield from read)
    except JobTimeout:
        if expires_at is not None:
            (status, deadline_ms, _), redis_time = yield from job_reads.look(keys, job_id)
            expiry(job_id, status, deadline_ms, redis_time)
        raise


def unended_expiry(
    job_id: str, status: str | None, deadline_ms: str | None, redis_time: tuple[int, int]
) -> float | None:
    """expiry() of a job a look found no result of (None: no such job yet): InvalidJob if its
    status is neither queued nor running (see UNENDED)."""
    if status is not None and status not in UNENDED:
        raise InvalidJob(job_id, UNPARSED)
    return expiry(job_id, status, deadline_ms, redis_time)


def expiry(job_id: str, status: str | None, deadline_ms: str | None, redis_time: tuple[int, int]) -> float | None:
    """When a queued job's deadline passes, on this process's monotonic clock (within a round trip
    of Redis's, late rather than early: the caller asks Redis again then); None if the job cannot
    expire unread (it has started or ended, has no deadline, or is not there). Raises JobExpired
    once it has passed, as `status()` reads it; InvalidJob for a deadline that is no number."""
    if status != "queued" or deadline_ms is None:
        return None
    if not (deadline_ms.isascii() and deadline_ms.isdigit()):
        raise InvalidJob(job_id, UNPARSED)
    left_us = us_left(int(deadline_ms), redis_time)
    if left_us < 0:
        raise JobExpired(job_id)
    return time.monotonic() + left_us / 1_000_000


def read_events(
    keys: Keys,
    job_id: str,
    after: str,
    count: int,
    deadline: Deadline,
    until: float | None = None,
    blocking: bool = True,
) -> Steps[list[Entry]]:
    """One blocking XREAD of the job's event stream (on a cluster, sent to the node of its key):
    up to `count` of its events after `after`, or none if none came within the deadline's next
    block (which ends by `until`, monotonic, if given). A read that Redis cut short returns none,
    and the caller reads again. Not `blocking`: the events there now, the deadline checked all the same."""
    block_ms = deadline.block_ms(until)
    reply = yield from job_reads.events_read(keys, job_id, after, count, block_ms if blocking else None)
    streams = streams_read(reply)
    return streams[0][1] if streams else []


def streams_read(reply: StreamsReply | Exception) -> list[tuple[str, list[Entry]]]:
    """An XREAD reply's streams: none if Redis cut a blocking read short (UNBLOCKED, in a
    failover: reading again is right); another error is raised."""
    if isinstance(reply, Exception):
        if read_cut_short(reply):
            return []
        raise reply
    return reply or []


def read_cut_short(error: Exception) -> bool:
    """A blocking read that Redis ended with UNBLOCKED: the server turned replica, or back, during
    a failover. Nothing was read; reading again is right."""
    return reply_code(error) == "UNBLOCKED"


def finished(job_id: str, result_json: str) -> JobResult:
    """The job's final result; a failed job raises JobFailed carrying it, an expired one JobExpired."""
    result = parse_result(job_id, result_json)
    if result.status == "expired":
        raise JobExpired(job_id, result)
    if result.status == "failed":
        error = result.error
        raise JobFailed(error.code if error else "error", error.message if error else "failed", result)
    return result
