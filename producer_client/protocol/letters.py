"""A queue's dead-letter stream `mili:dead:{queue}`: DEADLETTER and LETTER (protocol.worker) write
its letters and REVIVE (protocol.producer) moves one back into the queue; here is every other
command on it, each a Steps (producer_client.steps): read letters from either end, one by its id, count
them, delete one, trim them. A letter's id is the time it died (Redis's clock), so the stream is in
order of death. An entry is (its id, its fields). A dead-letter stream of another type (an
operator's mistake: only workers may write it) reads as one with no letters, which it holds: the DEL
that changed its type took them, and the next letter makes it a stream anew (LUA_ADD_LETTER)."""

from __future__ import annotations

from typing import Any, Literal

from producer_client.connection import unless_other_type
from producer_client.keys import Keys
from producer_client.steps import Steps

Entry = tuple[str, dict[str, str]]
# The dead-letter stream keeps about this many entries (XADD MAXLEN ~): bounded memory, and far
# more than an operator reads before acting on the alert.
DEAD_LETTER_MAXLEN = 10_000


def newest_letters(keys: Keys, queue: str, count: int, before: str = "+") -> Steps[list[Entry]]:
    """Up to `count` letters, newest first, from `before` down (XREVRANGE; "(" before an id
    excludes it)."""
    (reply,) = yield lambda pipe: pipe.xrevrange(keys.dead(queue), before, "-", count=count)
    entries: list[Entry] = unless_other_type(reply, [])
    return entries


def oldest_letters(keys: Keys, queue: str, after: str, last: str, count: int) -> Steps[list[Entry]]:
    """Up to `count` letters, oldest first, from `after` up to `last` (XRANGE)."""
    (reply,) = yield lambda pipe: pipe.xrange(keys.dead(queue), after, last, count=count)
    entries: list[Entry] = unless_other_type(reply, [])
    return entries


def letter_at(keys: Keys, queue: str, letter_id: str) -> Steps[Entry | None]:
    """The letter whose id is `letter_id`, if there is one."""
    (reply,) = yield lambda pipe: pipe.xrange(keys.dead(queue), letter_id, letter_id)
    entries: list[Entry] = unless_other_type(reply, [])
    return entries[0] if entries else None


def add_letter_count(pipe: Any, keys: Keys, queue: str) -> None:
    """XLEN of the dead-letter stream, among a pipeline's other reads: letter_count reads its reply."""
    pipe.xlen(keys.dead(queue))


def letter_count(reply: Any) -> int:
    """add_letter_count's reply: 0 where the stream is of another type."""
    count: int = unless_other_type(reply, 0)
    return count


def delete_letter(keys: Keys, queue: str, letter_id: str) -> Steps[bool]:
    """Whether there was such a letter to delete."""
    (reply,) = yield lambda pipe: pipe.xdel(keys.dead(queue), letter_id)
    return bool(unless_other_type(reply, 0))


def trim_letters(keys: Keys, queue: str, strategy: Literal["MAXLEN", "MINID"], threshold: int) -> Steps[int]:
    """XTRIM, exact (no ~): MAXLEN 0 removes every letter, MINID every one older than `threshold`
    ms. Returns how many it removed."""
    (reply,) = yield lambda pipe: pipe.execute_command("XTRIM", keys.dead(queue), strategy, threshold)
    removed: int = unless_other_type(reply, 0)
    return removed
