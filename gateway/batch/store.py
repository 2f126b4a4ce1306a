"""Where the Batch API keeps its files and batches: in the queue's Redis, so that every gateway
sees the same ones and none holds state of its own (see producer_client.keys for the keys).

A file is a hash of metadata and a list of pieces of its text, each a run of whole lines of at
most PIECE_CHARS characters: written and read a piece at a time, never one command of the whole
file. A batch's copy of its input lines is a hash of runs of LINES_PER_FIELD lines. Both keep a
value per run of lines rather than per line: Redis's allocator rounds every value up to a size
class, which on a value per line cost about a fifth of the text again. Files
expire `ttl_s` after they are written; a batch expires `ttl_s` after it ends, and until then it
has no TTL, however long it runs. A batch records the TTL of the gateway that created it, which
its output files get too, whichever gateway writes them.

Every write a batch's driver makes is safe to repeat, and to race with a second driver that has
not yet noticed it lost its lease: a line is answered through ANSWER, whose SETBIT lets only the
first answer of a line in; statuses move through TRANSITION, from the statuses named only.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import redis.asyncio as aioredis

from gateway.batch.schema import Batch, BatchList, FileList, FileObject
from openai_format.batch_lines import OutputLine, jsonl_lines
from producer_client.keys import Keys
from producer_client.protocol import batch as scripts
from producer_client.protocol.execution import aexecute
from producer_client.protocol.script import ScriptCall

PIECE_CHARS = 1 << 18  # a file's text per list element, at most: 1 MiB of UTF-8 at the most
PIECES_PER_READ = 8
LINES_PER_FIELD = 64  # a batch's input lines per hash field
ANSWERS_PER_READ = 1000


class Pieces:
    """Lines (each with its newline) gathered into pieces of at most PIECE_CHARS characters, each
    ending on a line; a longer line is a piece of its own."""

    def __init__(self):
        self.lines: list[str] = []
        self.size = 0

    def add(self, line: str) -> str | None:
        """The piece that `line` does not fit in, once there is one."""
        full = None
        if self.lines and self.size + len(line) > PIECE_CHARS:
            full = self.rest()
        self.lines.append(line)
        self.size += len(line)
        return full

    def rest(self) -> str | None:
        piece = "".join(self.lines) or None
        self.lines, self.size = [], 0
        return piece


def owned_by(owner: str | None) -> dict[str, str]:
    """The `owner` field of a file's or batch's hash: the tenant (API key) that created it."""
    return {} if owner is None else {"owner": owner}


def text_pieces(text: str) -> list[str]:
    pieces = Pieces()
    whole = [piece for line in jsonl_lines(text, keepends=True) if (piece := pieces.add(line)) is not None]
    last = pieces.rest()
    return whole + ([last] if last else [])


class BatchStore:
    def __init__(self, client: aioredis.Redis, keys: Keys):
        self.redis = client
        self.keys = keys

    async def _run(self, call: ScriptCall):
        return (await self._run_many([call]))[0]

    async def _run_many(self, calls: list[ScriptCall]) -> list:
        """`calls` in one pipeline (execution.aexecute: a cluster's pipeline refuses redis-py's
        script objects, and a server that lost a script gets it again)."""
        return await aexecute(self.redis, lambda pipe: [call.add_to(pipe) for call in calls], scripts.BATCH_SCRIPTS)

    # -- files ---------------------------------------------------------------------------------

    async def put_file(
        self,
        file_id: str,
        filename: str,
        purpose: str,
        pieces: AsyncIterator[str],
        now: int,
        ttl_s: int,
        owner: str | None,
    ) -> FileObject | None:
        """Store a file of `owner` (a tenant's id) from its pieces (None if there are none): the
        pieces first, the metadata last, so that a file whose writer died half-way is not found,
        and its pieces expire."""
        content = self.keys.file_content(file_id)
        await self.redis.delete(content)
        size = 0
        async for piece in pieces:
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(content, piece)
            pipe.expire(content, ttl_s)
            await pipe.execute()
            size += len(piece.encode())
        if not size:
            return None
        file = FileObject(
            id=file_id, bytes=size, created_at=now, expires_at=now + ttl_s, filename=filename, purpose=purpose
        )
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.file(file_id), mapping={**file.model_dump(), **owned_by(owner)})
        pipe.expire(self.keys.file(file_id), ttl_s)
        created = time.time()
        pipe.zadd(self.keys.files(), {file_id: created})
        if owner is not None:
            pipe.zadd(self.keys.files_of(owner), {file_id: created})
        await pipe.execute()
        return file

    async def file(self, file_id: str, owned: Callable[[str | None], bool] = lambda owner: True) -> FileObject | None:
        """The file, if it exists and `owned(its owner)`."""
        fields = await self.redis.hgetall(self.keys.file(file_id))
        return FileObject.model_validate(fields) if fields and owned(fields.get("owner")) else None

    async def file_text(self, file_id: str) -> AsyncIterator[str]:
        key = self.keys.file_content(file_id)
        start = 0
        while pieces := await self.redis.lrange(key, start, start + PIECES_PER_READ - 1):
            for piece in pieces:
                yield piece
            start += len(pieces)

    async def delete_file(self, file_id: str) -> bool:
        owner = await self.redis.hget(self.keys.file(file_id), "owner")
        await self.redis.zrem(self.keys.files(), file_id)
        if owner is not None:
            await self.redis.zrem(self.keys.files_of(owner), file_id)
        return bool(await self.redis.delete(self.keys.file(file_id), self.keys.file_content(file_id)))

    async def list_files(
        self,
        after: str | None,
        limit: int,
        newest_first: bool,
        purpose: str | None,
        owner: str | None,
    ) -> FileList:
        """`limit` files after the file `after`, of `purpose` if given, of `owner` (None: of every
        owner); files that expired leave the index."""
        index = self.keys.files() if owner is None else self.keys.files_of(owner)
        rank_of, range_of = (
            (self.redis.zrevrank, self.redis.zrevrange) if newest_first else (self.redis.zrank, self.redis.zrange)
        )
        start = 0
        if after is not None:
            rank = await rank_of(index, after)
            start = 0 if rank is None else rank + 1
        files: list[FileObject] = []
        while len(files) <= limit and (ids := await range_of(index, start, start + limit)):
            start += len(ids)
            found = await self._files(ids)
            gone = [file_id for file_id, file in zip(ids, found) if file is None]
            if gone:
                await self.redis.zrem(index, *gone)
                start -= len(gone)
            files += [f for f in found if f is not None and purpose in (None, f.purpose)]
        page = files[:limit]
        return FileList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(files) > limit,
        )

    async def _files(self, file_ids: list[str]) -> list[FileObject | None]:
        pipe = self.redis.pipeline(transaction=False)
        for file_id in file_ids:
            pipe.hgetall(self.keys.file(file_id))
        return [FileObject.model_validate(fields) if fields else None for fields in await pipe.execute()]

    # -- batches -------------------------------------------------------------------------------

    async def create_batch(self, batch: Batch, ttl_s: int, owner: str) -> None:
        # Indexed by the time to the microsecond: batches created within a second keep their order.
        created = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.batch(batch.id), mapping={**batch.fields(), "ttl_s": ttl_s, **owned_by(owner)})
        pipe.zadd(self.keys.batches(), {batch.id: created})
        pipe.zadd(self.keys.batches_of(owner), {batch.id: created})
        pipe.zadd(self.keys.batches_unfinished(), {batch.id: created})
        await pipe.execute()

    async def batch_fields(self, batch_id: str) -> dict[str, str]:
        return await self.redis.hgetall(self.keys.batch(batch_id))

    async def batch(self, batch_id: str, owned: Callable[[str | None], bool] = lambda owner: True) -> Batch | None:
        """The batch, if it exists and `owned(its owner)`."""
        fields = await self.batch_fields(batch_id)
        return Batch.from_fields(fields) if fields and owned(fields.get("owner")) else None

    async def batch_owner(self, batch_id: str) -> str | None:
        return await self.redis.hget(self.keys.batch(batch_id), "owner")

    async def list_batches(self, after: str | None, limit: int, owner: str | None) -> BatchList:
        """Newest first, `limit` after the batch `after`, of `owner` (None: of every owner);
        batches that expired leave the index."""
        index = self.keys.batches() if owner is None else self.keys.batches_of(owner)
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(index, after)
            start = 0 if rank is None else rank + 1
        ids = await self.redis.zrevrange(index, start, start + limit)
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids:
            pipe.hgetall(self.keys.batch(batch_id))
        found = await pipe.execute()
        gone = [batch_id for batch_id, fields in zip(ids, found) if not fields]
        if gone:
            await self.redis.zrem(index, *gone)
        batches = [Batch.from_fields(fields) for fields in found if fields]
        page = batches[:limit]
        return BatchList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(batches) > limit,
        )

    async def unfinished(self) -> list[str]:
        return await self.redis.zrange(self.keys.batches_unfinished(), 0, -1)

    async def transition(
        self, batch_id: str, allowed: str, status: str, at_field: str, now: int, **fields
    ) -> str | None:
        """Move the batch to `status` if it is in one of `allowed` (space-separated)."""
        return await self._run(scripts.transition(self.keys, batch_id, allowed, status, at_field, now, fields))

    async def set_fields(self, batch_id: str, **fields) -> None:
        await self.redis.hset(self.keys.batch(batch_id), mapping=fields)

    async def store_input(self, batch_id: str, lines: list[str]) -> None:
        """Line i goes in field i // LINES_PER_FIELD, with its neighbours (the lines have no newline)."""
        key = self.keys.batch_input(batch_id)
        runs = {
            str(n): "\n".join(lines[start : start + LINES_PER_FIELD])
            for n, start in enumerate(range(0, len(lines), LINES_PER_FIELD))
        }
        names = list(runs)
        pipe = self.redis.pipeline(transaction=False)
        for start in range(0, len(names), ANSWERS_PER_READ):
            pipe.hset(key, mapping={name: runs[name] for name in names[start : start + ANSWERS_PER_READ]})
        await pipe.execute()

    async def input_lines(self, batch_id: str, indexes: list[int]) -> list[str]:
        """The input lines at `indexes`, in that order."""
        fields = sorted({i // LINES_PER_FIELD for i in indexes})
        if not fields:
            return []
        runs = await self.redis.hmget(self.keys.batch_input(batch_id), [str(n) for n in fields])
        lines_of = {n: run.split("\n") for n, run in zip(fields, runs)}
        return [lines_of[i // LINES_PER_FIELD][i % LINES_PER_FIELD] for i in indexes]

    async def unanswered(self, batch_id: str, upto: int) -> list[int]:
        """The lines below `upto` not answered yet: those from the first clear bit of the
        answered bitmap (BITPOS) on, looked at one by one."""
        key = self.keys.batch_answered(batch_id)
        first = await self.redis.bitpos(key, 0)
        pipe = self.redis.pipeline(transaction=False)
        for index in range(first, upto):
            pipe.getbit(key, index)
        bits = await pipe.execute() if first < upto else []
        return [index for index, bit in zip(range(first, upto), bits) if not bit]

    async def answer(self, batch_id: str, answers: list[tuple[int, OutputLine]]) -> None:
        await self._run_many(
            [scripts.answer(self.keys, batch_id, index, line.ok, line.model_dump_json()) for index, line in answers]
        )

    async def answers(self, batch_id: str, ok: bool) -> AsyncIterator[list[str]]:
        key = self.keys.batch_output(batch_id) if ok else self.keys.batch_errors(batch_id)
        start = 0
        while page := await self.redis.lrange(key, start, start + ANSWERS_PER_READ - 1):
            yield page
            start += len(page)

    async def finish(self, batch_id: str, status: str, at_field: str, now: int, ttl_s: int, **files: str) -> None:
        await self._run(scripts.finish(self.keys, batch_id, status, at_field, now, ttl_s, files))
        await self.redis.zrem(self.keys.batches_unfinished(), batch_id)

    # -- leases --------------------------------------------------------------------------------

    async def take_lease(self, batch_id: str, holder: str, ttl_ms: int) -> bool:
        return bool(await self.redis.set(self.keys.batch_lease(batch_id), holder, nx=True, px=ttl_ms))

    async def renew_lease(self, batch_id: str, holder: str, ttl_ms: int) -> bool:
        return bool(await self._run(scripts.renew(self.keys, batch_id, holder, ttl_ms)))

    async def release_lease(self, batch_id: str, holder: str) -> None:
        await self._run(scripts.release(self.keys, batch_id, holder))
