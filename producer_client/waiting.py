"""How a client waits on a job's streams: a caller's timeout as a series of bounded blocking
reads (Deadline), each one XREAD as a step (producer_client.steps), a read that Redis cut short,
the deadline of a job still queued (JobExpired as soon as it passes: no worker will start it),
and the end waited for (a result, JobFailed or JobExpired). A job's result is in its hash from its
end on; its `done` stream, which a blocking read wakes on, lives only DONE_TTL_MS after the end
(producer_client/keys.py), so each blocking read is followed by a look at the hash."""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from typing import TypeVar

from producer_client.connection import reply_code
from producer_client.errors import JobTimeout
from producer_client.keys import DONE_TTL_MS, Keys
from producer_client.protocol import job_reads
from producer_client.protocol.clock import epoch_ms
from producer_client.protocol.job_reads import Entry, StreamsReply
from producer_client.schema import JobExpired, JobFailed, JobResult
from producer_client.steps import Steps

T = TypeVar("T")

MAX_BLOCK_MS = 2000  # one blocking read, well inside redis-py's default 5 s socket timeout


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
# How many jobs a client remembers (Expiries): the submits not yet waited for. A job past them is
# looked at first, as one submitted elsewhere.
REMEMBERED_JOBS = 10_000
# How long after its submit a job's first blocking read needs no look at the job before it: it
# cannot have ended longer ago than its `done` stream lives (DONE_TTL_MS from its end; half of
# that, for the submit's reply on its way back and the two clocks' rates).
FRESH_S = DONE_TTL_MS / 1000 / 2


class Expiries:
    """When each job a client created lately expires unread (monotonic; None: it cannot), so that
    a wait() soon after its submit needs no first look at the job: the wait is one round trip. A
    job with a fresh id only (one found by its request_id may be older), while it is fresh
    (FRESH_S: later, its `done` stream may be gone, and the look finds its result at once instead
    of a read blocking for nothing); the oldest are forgotten past REMEMBERED_JOBS; a wait takes its
    job's entry. An OrderedDict: each of its calls here is one C call, atomic under the GIL, so the
    threads of a client share it unlocked."""

    def __init__(self, size: int = REMEMBERED_JOBS):
        self.size = size
        self.jobs: OrderedDict[str, tuple[float, float | None]] = OrderedDict()  # (submitted at, expires at)

    def remember(self, job_id: str, expires_at: float | None) -> None:
        self.jobs[job_id] = (time.monotonic(), expires_at)
        if len(self.jobs) > self.size:
            try:
                self.jobs.popitem(last=False)
            except KeyError:  # another thread emptied it between the two calls
                pass

    def take(self, job_id: str) -> float | None:
        """The job's expiry as remembered, if it is fresh; UNKNOWN otherwise (a job not remembered, or
        no longer fresh). Forgotten now."""
        submitted_at, expires_at = self.jobs.pop(job_id, (-math.inf, UNKNOWN))
        return expires_at if time.monotonic() - submitted_at < FRESH_S else UNKNOWN


def wait_done(keys: Keys, job_id: str, deadline: Deadline, expires_at: float | None = UNKNOWN) -> Steps[str]:
    """The job's result JSON: there at once if the job has ended, else from its `done` stream when
    it does. A job still queued when its deadline passes raises JobExpired then, not at the
    caller's timeout. `expires_at`: when the job's deadline passes (monotonic), None if it cannot
    expire unread; UNKNOWN: read it with a first look at the job that does not block."""
    if expires_at == UNKNOWN:
        (status, deadline_ms, result), redis_time = yield from job_reads.look(keys, job_id)
        if result is not None:
            return result
        expires_at = expiry(job_id, status, deadline_ms, redis_time)
    while True:
        if expires_at is not None and time.monotonic() >= expires_at:
            (status, deadline_ms, result), redis_time = yield from job_reads.look(keys, job_id)
            if result is not None:
                return result
            expires_at = expiry(job_id, status, deadline_ms, redis_time)
        result = yield from unless_expired(keys, job_id, expires_at, read_done(keys, job_id, deadline, expires_at))
        if result is not None:
            return result


def read_done(keys: Keys, job_id: str, deadline: Deadline, until: float | None) -> Steps[str | None]:
    """One blocking XREAD of the job's `done` stream, then the hash's result: the result JSON, or
    None if the job did not end within the deadline's next block (ending by `until`). The hash is
    read after the XREAD, in the same round trip: a job that ended before the read began, longer
    ago than its done stream lives, is found there (the read then blocked for nothing, once)."""
    block_ms = deadline.block_ms(until)
    reply, result = yield from job_reads.end_read(keys, job_id, block_ms)
    streams = streams_read(reply)
    if streams:
        return streams[0][1][0][1]["data"]
    if isinstance(result, Exception):
        raise result
    return result


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


def expiry(job_id: str, status: str | None, deadline_ms: str | None, redis_time: tuple[int, int]) -> float | None:
    """When a queued job's deadline passes, on this process's monotonic clock (within a round trip
    of Redis's, late rather than early: the caller asks Redis again then); None if the job cannot
    expire unread (it has started or ended, has no deadline, or is not there). Raises JobExpired
    once it has passed, as `status()` reads it."""
    if status != "queued" or deadline_ms is None:
        return None
    left_ms = int(deadline_ms) - epoch_ms(redis_time)
    if left_ms < 0:
        raise JobExpired(job_id)
    return time.monotonic() + (left_ms + 1) / 1000


def read_events(
    keys: Keys, job_id: str, after: str, count: int, deadline: Deadline, until: float | None = None
) -> Steps[list[Entry]]:
    """One blocking XREAD of the job's event stream (on a cluster, sent to the node of its key):
    up to `count` of its events after `after`, or none if none came within the deadline's next
    block (which ends by `until`, monotonic, if given). A read that Redis cut short returns none,
    and the caller reads again."""
    block_ms = deadline.block_ms(until)
    reply = yield from job_reads.events_read(keys, job_id, after, count, block_ms)
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
    result = JobResult.model_validate_json(result_json)
    if result.status == "expired":
        raise JobExpired(job_id, result)
    if result.status == "failed":
        error = result.error
        raise JobFailed(error.code if error else "error", error.message if error else "failed", result)
    return result
