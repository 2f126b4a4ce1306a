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
DEFAULT_LIMIT = 20  # items a listing returns unless told: the dead letters', the waiting and running jobs'
EVENT_ID = re.compile(r"\d{1,20}-\d{1,20}")
# A stream id in each form Redis documents for reading after it (XREAD): `ms-seq`, or `ms` alone,
# which it reads as `ms-0` (`0`: from the start); each part at most 2^64 - 1, leading zeros allowed.
# (Redis's own parse, strtoull, also lets a part begin with spaces or a plus sign: no documented
# form, refused.) `$` is resolved where it means something (job_stream.follow).
STREAM_ID = re.compile(r"([0-9]+)(?:-([0-9]+))?")
MAX_ID_PART = 2**64 - 1


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
    """`after`, a stream id Redis reads (STREAM_ID), as the full id it means: `0` is `0-0`."""
    found = STREAM_ID.fullmatch(after) if isinstance(after, str) else None
    parts = [] if found is None else [id_part(part or "0") for part in found.groups()]
    if found is None or None in parts:
        raise InvalidArgument("after", "must be an event id such as '1700000000000-0' (or '1700000000000', '0')")
    return f"{parts[0]}-{parts[1]}"


def id_part(digits: str) -> int | None:
    """A stream id's part, or None past 2^64 - 1 (leading zeros first: int() refuses over 4,300 digits)."""
    significant = digits.lstrip("0") or "0"
    value = int(significant) if len(significant) <= 20 else None
    return value if value is not None and value <= MAX_ID_PART else None


def check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 or math.isinf(timeout):
        raise InvalidArgument("timeout", "must be a positive number of seconds, or None to wait forever")
    return float(timeout)


def check_max_queue_depth(max_queue_depth: Any) -> int | None:
    return optional_positive_int("max_queue_depth", max_queue_depth, "for no limit")


def check_max_connections(max_connections: Any) -> int | None:
    """The pool's bound, as a URL's `max_connections` option is checked (connection.py): redis-py
    raised its own ValueError for a negative one and took 0 for no bound at all."""
    return optional_positive_int("max_connections", max_connections, "for the default pool")


def optional_positive_int(name: str, value: Any, when_none: str) -> int | None:
    """A positive int (not a bool) or None, which means `when_none`."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise InvalidArgument(name, f"must be a positive integer, or None {when_none}")
    return value


def check_placement(placement: Any) -> bool:
    """Placement on or off: a bool only, as a string such as "false" or "no" would read as on."""
    if not isinstance(placement, bool):
        raise InvalidArgument("placement", "must be True or False")
    return placement


def check_limit(limit: Any) -> int:
    """How many items an operator's listing returns."""
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
        raise InvalidArgument("limit", f"must be an integer from 1 to {MAX_LIMIT}")
    return limit
