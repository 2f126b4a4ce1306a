"""The Batch API's files in Redis, every command on their keys (producer_client.keys: file,
file_content, files, files_of), each operation a Steps (producer_client.steps) that the gateway's
store (gateway/batch/store.py) runs over its connection.

A file is a hash of its object's fields and its `owner` (the tenant that created it), and its text
as a list of pieces, each a run of whole lines: written and read a piece at a time, never one
command of the whole file. Both expire `ttl_s` after they are written. The indexes (every file,
each owner's) are sorted sets by creation time, without a TTL: a file that expired leaves them
when a listing meets it. The pieces go first and the hash last, so that a file whose writer died
half-way is not found, and its pieces expire."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from producer_client.connection import is_other_type
from producer_client.keys import Keys
from producer_client.protocol.execution import Pipe
from producer_client.steps import Repeatable, Steps, checked

PIECES_PER_READ = 8


def indexes_read(indexes: Sequence[str], member: str) -> Steps[None]:
    """A read (ZSCORE) of each index that a write is about to change, with the keys it indexes:
    one of another type (an operator's mistake: the gateway's user alone writes them) is then a
    WRONGTYPE with nothing written. In the write's own pipeline the other commands ran around the
    one it failed (Redis undoes none, in MULTI neither): a file deleted, a batch stored and driven,
    each answered 500 key_of_another_type."""
    checked((yield Repeatable(lambda pipe: [pipe.zscore(index, member) for index in indexes])))


def file_indexes(keys: Keys, owner: str | None) -> list[str]:
    """The indexes a file of `owner` is in: every file's, and its owner's."""
    return [keys.files()] + ([keys.files_of(owner)] if owner is not None else [])


def clear_content(keys: Keys, file_id: str, owner: str | None) -> Steps[None]:
    """The start of a file's upload: its indexes read (indexes_read), then no text under its id."""
    yield from indexes_read(file_indexes(keys, owner), file_id)
    checked((yield lambda pipe: pipe.delete(keys.file_content(file_id))))


def drop_unfinished(keys: Keys, file_id: str) -> Steps[None]:
    """The keys of a file whose writing failed part-way (a DEL, which Redis serves past maxmemory
    too): its text, and its hash if that went in before an index's ZADD failed. An index that
    names it drops it at its next listing, as it drops an expired file."""
    checked((yield lambda pipe: pipe.delete(keys.file(file_id), keys.file_content(file_id))))


def append_piece(keys: Keys, file_id: str, piece: str, ttl_s: int) -> Steps[None]:
    content = keys.file_content(file_id)
    checked((yield lambda pipe: (pipe.rpush(content, piece), pipe.expire(content, ttl_s))))


def add_file(
    keys: Keys, file_id: str, fields: Mapping[str, str | int | float], owner: str | None, ttl_s: int, created: float
) -> Steps[None]:
    """The file's hash, once its pieces are in, and its place in the indexes (`created`: epoch
    seconds, their order)."""

    def add(pipe: Pipe) -> None:
        pipe.hset(keys.file(file_id), mapping={**fields, **owned_by(owner)})
        pipe.expire(keys.file(file_id), ttl_s)
        pipe.zadd(keys.files(), {file_id: created})
        if owner is not None:
            pipe.zadd(keys.files_of(owner), {file_id: created})

    checked((yield add))


def owned_by(owner: str | None) -> dict[str, str]:
    """The `owner` field of a file's or batch's hash: the tenant (API key) that created it."""
    return {} if owner is None else {"owner": owner}


def file_fields(keys: Keys, file_id: str) -> Steps[dict[str, str]]:
    """The file's hash ({} if there is no such file)."""
    fields: dict[str, str]
    (fields,) = checked((yield lambda pipe: pipe.hgetall(keys.file(file_id))))
    return fields


def pieces(keys: Keys, file_id: str, start: int) -> Steps[list[str]]:
    """Up to PIECES_PER_READ pieces of the file's text from piece `start` ([] past its end)."""
    found: list[str]
    (found,) = checked((yield lambda pipe: pipe.lrange(keys.file_content(file_id), start, start + PIECES_PER_READ - 1)))
    return found


def delete_file(keys: Keys, file_id: str) -> Steps[bool]:
    """The file out of its indexes, then its keys; whether it existed."""
    (owner,) = checked((yield lambda pipe: pipe.hget(keys.file(file_id), "owner")))
    yield from indexes_read(file_indexes(keys, owner), file_id)

    def delete(pipe: Pipe) -> None:
        pipe.zrem(keys.files(), file_id)
        if owner is not None:
            pipe.zrem(keys.files_of(owner), file_id)
        pipe.delete(keys.file(file_id), keys.file_content(file_id))

    *_, deleted = checked((yield delete))
    return bool(deleted)


def index_range(index: str, start: int, stop: int, newest_first: bool) -> Callable[[Any], None]:
    """The command reading ranks start..stop of a sorted set, in either order."""
    return lambda pipe: (pipe.zrevrange if newest_first else pipe.zrange)(index, start, stop)


class Listed(NamedTuple):
    """A page of a listing (files' or batches'), read on past the page's end by one."""

    found: list[dict[str, str]]  # the hashes found, up to `limit` + 1
    other_type: list[str]  # the ids met whose hash holds another type (an operator's mistake)


def hashes_of(replies: list[Any]) -> list[dict[str, str] | None]:
    """HGETALL replies of a listing's entries: {} for an expired one, None for a key of another
    type, which is left out (and named) rather than made the whole listing's 500."""
    return [None if is_other_type(reply) else checked([reply])[0] for reply in replies]


def listed_files(
    keys: Keys, after: str | None, limit: int, newest_first: bool, purpose: str | None, owner: str | None
) -> Steps[Listed]:
    """The hashes of the files after the file `after` in the index of `owner` (None: every
    owner's), of `purpose` if given, in order: more than `limit` if there are, so that the caller
    knows there are more. Files that expired leave the index; a file whose hash holds another type
    is left out and named in `other_type` (it stays in the index, its GET a 500
    key_of_another_type): one such file made every listing that 500."""
    index = keys.files() if owner is None else keys.files_of(owner)
    start = yield from rank_after(index, after, newest_first)
    listed = Listed([], [])
    # A yielded step runs before the generator resumes, so its lambda reads this iteration's values.
    while len(listed.found) <= limit:
        (ids,) = checked((yield index_range(index, start, start + limit, newest_first)))
        if not ids:
            break
        start += len(ids)
        hashes = hashes_of((yield lambda pipe: [pipe.hgetall(keys.file(file_id)) for file_id in ids]))  # noqa: B023
        listed.other_type.extend(file_id for file_id, fields in zip(ids, hashes) if fields is None)
        gone = [file_id for file_id, fields in zip(ids, hashes) if fields == {}]
        if gone:
            checked((yield lambda pipe: pipe.zrem(index, *gone)))  # noqa: B023
            start -= len(gone)
        listed.found.extend(fields for fields in hashes if fields and purpose in (None, fields.get("purpose")))
    return listed


def rank_after(index: str, after: str | None, newest_first: bool) -> Steps[int]:
    """Where a page after the id `after` starts in the sorted set `index` (0 for no such id)."""
    if after is None:
        return 0
    (rank,) = checked((yield lambda pipe: (pipe.zrevrank if newest_first else pipe.zrank)(index, after)))
    return 0 if rank is None else rank + 1
