"""How a client waits on a job's streams: a caller's timeout as a series of bounded blocking
reads (Deadline), each one XREAD as a step (producer_client.steps), a read that Redis cut short,
and the end waited for (a result, or JobFailed)."""

from __future__ import annotations

import time

from producer_client.connection import reply_code
from producer_client.errors import JobTimeout
from producer_client.keys import Keys
from producer_client.schema import JobFailed, JobResult
from producer_client.steps import Repeatable, Steps

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

    def block_ms(self) -> int:
        if self.at is None:
            return MAX_BLOCK_MS
        left = self.at - time.monotonic()
        if left <= 0:
            raise JobTimeout(self.job_id, self.timeout)
        return max(1, min(MAX_BLOCK_MS, int(left * 1000)))


def wait_done(keys: Keys, job_id: str, deadline: Deadline) -> Steps[str]:
    """The job's result JSON, from its `done` stream: there at once if the job has ended."""
    while True:
        entries = yield from xread(keys.done(job_id), "0-0", 1, deadline)
        if entries:
            return entries[0][1]["data"]


def xread(key: str, after: str, count: int, deadline: Deadline) -> Steps[list]:
    """One blocking XREAD of one stream (on a cluster, sent to the node of its key): up to `count`
    of its entries after `after`, or none if none came within the deadline's next block. A read
    that Redis cut short returns none, and the caller reads again."""
    block_ms = deadline.block_ms()
    (reply,) = yield Repeatable(lambda pipe: pipe.xread({key: after}, count=count, block=block_ms))
    streams = streams_read(reply)
    return streams[0][1] if streams else []


def streams_read(reply: list | Exception | None) -> list:
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
    """The job's final result; a failed job raises JobFailed carrying it."""
    result = JobResult.model_validate_json(result_json)
    if result.status == "failed":
        error = result.error
        raise JobFailed(error.code if error else "error", error.message if error else "failed", result)
    return result
