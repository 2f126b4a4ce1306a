"""The checks of the arguments the clients take besides a job's own (producer_client.new_job
validates those): ids, timeouts, bounds. Each raises InvalidArgument naming the argument, before
anything reaches Redis."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

from producer_client.errors import InvalidArgument
from producer_client.keys import check_name

MAX_LIMIT = 10_000  # items one listing returns at most: as many as a dead-letter stream holds
EVENT_ID = re.compile(r"\d{1,20}-\d{1,20}")


def check_job_id(job_id: Any) -> str:
    return check_name("job_id", job_id)


def check_job_ids(job_ids: Any) -> list[str]:
    """Many jobs' ids. One id given alone is refused: as an iterable it is its characters, so
    cancel_many(job_id) passed over 32 jobs that do not exist and cancelled nothing, silently."""
    if isinstance(job_ids, (str, bytes)):
        raise InvalidArgument("job_ids", "must be a list of job ids, not one id: wrap it, [job_id]")
    if not isinstance(job_ids, Iterable):  # None, a number: a TypeError from the loop below
        raise InvalidArgument("job_ids", "must be a list of job ids")
    return [check_job_id(job_id) for job_id in job_ids]


def check_event_id(after: Any) -> str:
    if not isinstance(after, str) or not EVENT_ID.fullmatch(after):
        raise InvalidArgument("after", "must be an event id such as '1700000000000-0'")
    return after


def check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or math.isinf(timeout):
        raise InvalidArgument("timeout", "must be a positive number of seconds, or None to wait forever")
    return float(timeout)


def check_max_queue_depth(max_queue_depth: Any) -> int | None:
    if max_queue_depth is not None and (
        isinstance(max_queue_depth, bool) or not isinstance(max_queue_depth, int) or max_queue_depth < 1
    ):
        raise InvalidArgument("max_queue_depth", "must be a positive integer, or None for no limit")
    return max_queue_depth


def check_limit(limit: Any) -> int:
    """How many items an operator's listing returns."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument("limit", f"must be an integer from 1 to {MAX_LIMIT}")
    return limit
