"""Where the Batch API keeps its files and batches: in the queue's Redis, so that every gateway
sees the same ones and none holds state of its own. How they lie there, and every command on
their keys, is the protocol's (producer_client/protocol/files.py and batch.py); the store turns
the gateway's objects into those commands' arguments and their replies back into objects.

A file's text is stored in pieces, each a run of whole lines of at most PIECE_CHARS characters:
written and read a piece at a time, never one command of the whole file. Files expire `ttl_s`
after they are written; a batch expires `ttl_s` after it ends. A batch records the TTL of the
gateway that created it, which its output files get too, whichever gateway writes them (unless
its `output_expires_after` gave them their own).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from gateway.batch.schema import Batch, BatchList, FileList, FileObject
from openai_format.batch_lines import OutputLine, jsonl_lines
from producer_client import AsyncClient
from producer_client.protocol import batch as batch_commands
from producer_client.protocol import files as file_commands
from producer_client.steps import Steps, T

log = logging.getLogger("gateway.batch")

PIECE_CHARS = 1 << 18  # a file's text per list element, at most: 1 MiB of UTF-8 at the most
LOGGED_IDS = 1024  # the ids of keys of another type a gateway remembers having warned about


class WarnedOnce:
    """The ids a warning was logged for, the LOGGED_IDS last ones: a listing meets a key of another
    type again every time until an operator deletes it, and is warned about it once; kept without
    a bound, the set grew by every id anyone made such a key under, for the gateway's life."""

    def __init__(self, most: int = LOGGED_IDS):
        self.most = most
        self.ids: OrderedDict[str, None] = OrderedDict()

    def first_time(self, key_id: str) -> bool:
        """Whether `key_id` is new here (and now remembered, the oldest one forgotten past `most`)."""
        if key_id in self.ids:
            self.ids.move_to_end(key_id)
            return False
        self.ids[key_id] = None
        if len(self.ids) > self.most:
            self.ids.popitem(last=False)
        return True


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


def text_pieces(text: str) -> list[str]:
    pieces = Pieces()
    whole = [piece for line in jsonl_lines(text, keepends=True) if (piece := pieces.add(line)) is not None]
    last = pieces.rest()
    return whole + ([last] if last else [])


class BatchStore:
    def __init__(self, client: AsyncClient):
        # The client's own connection pool: the store's commands go where its jobs go.
        self.client = client
        self.keys = client.keys
        self.other_type_warned = WarnedOnce()  # files and batches of another type (log_other_type)

    async def _run(self, steps: Steps[T]) -> T:
        """A protocol operation over the store's connection (a server that lost the batch
        scripts gets them again)."""
        return await self.client.run_protocol(steps, batch_commands.BATCH_SCRIPTS)

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
        """Store a file of `owner` (a tenant's id) from its pieces (None if there are none). A write
        that fails (Redis past maxmemory) takes what was written before it with it: no call could
        name the pieces (the hash goes last), which held what memory Redis had for `ttl_s`, a copy
        more for each retry of an upload."""
        await self._run(file_commands.clear_content(self.keys, file_id, owner))
        try:
            size = 0
            async for piece in pieces:
                await self._run(file_commands.append_piece(self.keys, file_id, piece, ttl_s))
                size += len(piece.encode())
            if not size:
                return None
            file = FileObject(
                id=file_id, bytes=size, created_at=now, expires_at=now + ttl_s, filename=filename, purpose=purpose
            )
            await self._run(file_commands.add_file(self.keys, file_id, file.model_dump(), owner, ttl_s, time.time()))
            return file
        except Exception:
            await self._drop_unfinished(file_id)
            raise

    async def _drop_unfinished(self, file_id: str) -> None:
        """The keys of a file whose writing failed, deleted if Redis takes the DEL; else they
        expire with their TTL, and the write's own error is the one raised."""
        try:
            await self._run(file_commands.drop_unfinished(self.keys, file_id))
        except Exception as e:
            log.warning("file %s: what its failed writing stored is left to expire: %s", file_id, e)

    async def file(self, file_id: str, owned: Callable[[str | None], bool] = lambda owner: True) -> FileObject | None:
        """The file, if it exists and `owned(its owner)`."""
        fields = await self._run(file_commands.file_fields(self.keys, file_id))
        return FileObject.model_validate(fields) if fields and owned(fields.get("owner")) else None

    async def file_text(self, file_id: str) -> AsyncIterator[str]:
        """The file's text, a piece at a time, its first pieces read by this call: a text of another
        type (WRONGTYPE) raises here, so that GET /v1/files/{id}/content answers its 500
        key_of_another_type before it begins, where it sent a 200 and then cut the body off."""
        first = await self._run(file_commands.pieces(self.keys, file_id, 0))
        return self._pieces(file_id, first)

    async def _pieces(self, file_id: str, pieces: list[str]) -> AsyncIterator[str]:
        start = 0
        while pieces:
            for piece in pieces:
                yield piece
            start += len(pieces)
            pieces = await self._run(file_commands.pieces(self.keys, file_id, start))

    async def delete_file(self, file_id: str) -> bool:
        return await self._run(file_commands.delete_file(self.keys, file_id))

    async def list_files(
        self,
        after: str | None,
        limit: int,
        newest_first: bool,
        purpose: str | None,
        owner: str | None,
    ) -> FileList:
        """`limit` files after the file `after`, of `purpose` if given, of `owner` (None: of every
        owner); a file whose hash holds another type left out, and logged once (listed_files)."""
        listed = await self._run(file_commands.listed_files(self.keys, after, limit, newest_first, purpose, owner))
        self.log_other_type("file", listed.other_type, self.keys.file)
        found = listed.found
        page = [FileObject.model_validate(fields) for fields in found[:limit]]
        return FileList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(found) > limit,
        )

    # -- batches -------------------------------------------------------------------------------

    async def create_batch(self, batch: Batch, ttl_s: int, owner: str, output_ttl_s: int | None = None) -> None:
        """`output_ttl_s`: how long its output files are kept (its `output_expires_after`), else `ttl_s`."""
        fields = batch.fields() | ({} if output_ttl_s is None else {"output_ttl_s": output_ttl_s})
        await self._run(batch_commands.create_batch(self.keys, batch.id, fields, ttl_s, owner, time.time()))

    async def batch_fields(self, batch_id: str) -> dict[str, str]:
        return await self._run(batch_commands.batch_fields(self.keys, batch_id))

    async def batch(self, batch_id: str, owned: Callable[[str | None], bool] = lambda owner: True) -> Batch | None:
        """The batch, if it exists and `owned(its owner)`."""
        fields = await self.batch_fields(batch_id)
        return Batch.from_fields(fields) if fields and owned(fields.get("owner")) else None

    async def batch_owner(self, batch_id: str) -> str | None:
        return await self._run(batch_commands.batch_owner(self.keys, batch_id))

    async def list_batches(self, after: str | None, limit: int, owner: str | None) -> BatchList:
        """Newest first, `limit` after the batch `after`, of `owner` (None: of every owner); a batch
        whose hash holds another type left out, and logged once (listed_batches)."""
        listed = await self._run(batch_commands.listed_batches(self.keys, after, limit, owner))
        self.log_other_type("batch", listed.other_type, self.keys.batch)
        batches = [Batch.from_fields(fields) for fields in listed.found]
        page = batches[:limit]
        return BatchList(
            data=page,
            first_id=page[0].id if page else None,
            last_id=page[-1].id if page else None,
            has_more=len(batches) > limit,
        )

    def log_other_type(self, kind: str, key_ids: list[str], key: Callable[[str], str]) -> None:
        """A warning per file or batch id (`kind`), once per gateway (WarnedOnce): every listing
        meets it again until an operator deletes the key."""
        for key_id in key_ids:
            if self.other_type_warned.first_time(f"{kind} {key_id}"):
                log.warning(
                    "%s %s: its hash %s holds another type than MILI writes there (WRONGTYPE): left out "
                    "of listings; an operator deletes it",
                    kind,
                    key_id,
                    key(key_id),
                )

    async def leave_unfinished(self, batch_id: str) -> None:
        await self._run(batch_commands.leave_unfinished(self.keys, batch_id))

    async def unfinished(self) -> list[str]:
        return await self._run(batch_commands.unfinished_batches(self.keys))

    async def transition(
        self, batch_id: str, allowed: str, status: str, at_field: str, now: int, **fields
    ) -> str | None:
        """Move the batch to `status` if it is in one of `allowed` (space-separated)."""
        return await self._run(batch_commands.move_batch(self.keys, batch_id, allowed, status, at_field, now, fields))

    async def set_fields(self, batch_id: str, **fields) -> None:
        await self._run(batch_commands.set_fields(self.keys, batch_id, fields))

    async def store_input(self, batch_id: str, lines: list[str]) -> None:
        await self._run(batch_commands.store_input(self.keys, batch_id, lines))

    async def input_lines(self, batch_id: str, indexes: list[int]) -> list[str]:
        """The input lines at `indexes`, in that order."""
        return await self._run(batch_commands.input_lines(self.keys, batch_id, indexes))

    async def unanswered(self, batch_id: str, upto: int) -> list[int]:
        """The lines below `upto` not answered yet."""
        return await self._run(batch_commands.unanswered_lines(self.keys, batch_id, upto))

    async def answer(self, batch_id: str, answers: list[tuple[int, OutputLine]]) -> None:
        """Each line's answer, once: a line answered before keeps its first answer."""
        lines = [(index, line.ok, line.model_dump_json()) for index, line in answers]
        await self._run(batch_commands.answer_lines(self.keys, batch_id, lines))

    async def answers(self, batch_id: str, ok: bool) -> AsyncIterator[list[str]]:
        start = 0
        while page := await self._run(batch_commands.answers_page(self.keys, batch_id, ok, start)):
            yield page
            start += len(page)

    async def finish(self, batch_id: str, status: str, at_field: str, now: int, ttl_s: int, **files: str) -> None:
        await self._run(batch_commands.finish_batch(self.keys, batch_id, status, at_field, now, ttl_s, files))

    # -- leases --------------------------------------------------------------------------------

    async def take_lease(self, batch_id: str, holder: str, ttl_ms: int) -> bool:
        return await self._run(batch_commands.take_lease(self.keys, batch_id, holder, ttl_ms))

    async def renew_lease(self, batch_id: str, holder: str, ttl_ms: int) -> bool:
        return await self._run(batch_commands.renew_lease(self.keys, batch_id, holder, ttl_ms))

    async def release_lease(self, batch_id: str, holder: str) -> None:
        await self._run(batch_commands.release_lease(self.keys, batch_id, holder))
