"""Redis's clock as the protocol reads it: TIME's reply, and stream entry ids, whose milliseconds
are the server's clock when it added the entry. The worker times a job's wait by its entry
(`entry_time`), the operator's views the age of entries and heartbeats, so that every host
measures on the one clock the deadlines are set by, whatever its own."""

from __future__ import annotations

RedisTime = tuple[int, int]  # TIME's reply: seconds and microseconds


def epoch_ms(redis_time: RedisTime) -> int:
    """TIME's reply (seconds, microseconds) in milliseconds."""
    seconds, micros = redis_time
    return int(seconds) * 1000 + int(micros) // 1000


def epoch_us(redis_time: RedisTime) -> int:
    """TIME's reply (seconds, microseconds) in microseconds."""
    seconds, micros = redis_time
    return int(seconds) * 1_000_000 + int(micros)


def us_left(deadline_ms: int, redis_time: RedisTime) -> int:
    """Microseconds from `redis_time` to a job's deadline (epoch ms); below 0 once it has passed.
    Passed means after it to the microsecond, as a worker compares it (worker/loop/admission.py:
    now > deadline): TIME's whole milliseconds (epoch_ms) left a deadline unpassed for up to a
    millisecond after it, and a caller whose timeout is the job's own, reaching its end in that
    millisecond, was answered JobTimeout for a job that had expired."""
    return deadline_ms * 1000 - epoch_us(redis_time)


def entry_time(entry_id: str) -> float:
    """When Redis added a stream entry: its id's milliseconds, in epoch seconds (Redis's clock)."""
    return entry_ms(entry_id) / 1000


def entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def entry_age_s(entry_id: str, now_ms: int) -> float:
    """How long ago Redis added the entry, from its clock's milliseconds: subtracted as integers,
    so an age of exactly 200 ms reads 0.2, not the 0.19999981 two epoch floats would give."""
    return (now_ms - entry_ms(entry_id)) / 1000


def entry_order(entry_id: str) -> tuple[int, int]:
    """An entry id as (milliseconds, sequence): ids compare in the order Redis added the entries."""
    milliseconds, sequence = entry_id.split("-")
    return int(milliseconds), int(sequence)
