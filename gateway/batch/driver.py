"""What moves batches forward. Gateways are stateless and any number may run, so every gateway
runs a BatchDriver, and each unfinished batch is driven by one gateway at a time: the holder of
its lease (a Redis key with a TTL, renewed at every step). A gateway that dies stops renewing,
the lease lapses after `batch_lease_s`, and another gateway (or the same one, restarted) takes
the batch on where it stood; a gateway that stops gracefully gives its leases up at once.

A batch's lines run as queue jobs whose ids derive from the batch and the line
(batch_lines.request_id), so a driver that takes a batch over submits its lines in flight again
and finds their jobs: queued and running ones are not added twice, ended ones are read back, and
only a job whose result expired from Redis (no gateway drove the batch for longer than the
workers' result_ttl_s) runs again. A line's answer goes in once (BatchStore.answer). So a batch
survives any gateway and any worker dying, and each custom_id is answered exactly once. The
lines in flight are openai_format.batch_flight's, as `mili batch`'s are.

    validating --(input checked)--> in_progress --(every line answered)--> finalizing --> completed
    validating --(a bad line)--> failed
    validating | in_progress --(POST .../cancel)--> cancelling --> cancelled
    validating | in_progress --(completion_window over)--> expired

On a cancel or at the window's end, the jobs in flight are cancelled; what ends before
CANCEL_GRACE_S is answered as it ended (a line that finished is in the output file), and every
line still unanswered gets the error `batch_cancelled` or `batch_expired` in the error file.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

import redis

from gateway.api_keys import queue_tenant
from gateway.batch.budget import InFlightBudget
from gateway.batch.schema import BatchErrors
from gateway.batch.store import BatchStore, Pieces
from gateway.cancellation import cancel_and_wait
from gateway.registry import ModelRegistry
from gateway.settings import GatewaySettings
from openai_format.batch_flight import REFUSALS, Flight
from openai_format.batch_lines import (
    LineErrorBody,
    LineJobs,
    LineRequest,
    OutputLine,
    answer,
    check_lines,
    error_answer,
    line_request,
    parse_line,
    request_id,
    unanswered,
)
from openai_format.errors import APIError
from producer_client import AsyncClient, BulkQueueFull
from producer_client.aio import built_apart
from producer_client.connection import is_other_type
from producer_client.protocol.batch import LINES_PER_FIELD

log = logging.getLogger("gateway.batch")

CANCEL_GRACE_S = 60.0  # how long the answers of cancelled jobs are awaited before lines are given up
READ_WAIT_S = 0.5  # the longest wait for results in one step: a cancel is seen within about this
PREPARED_APART_CHARS = 1 << 20  # the text of the lines prepared in one hop to the builder thread, at most
MAX_JOB_TIMEOUT_S = 7 * 24 * 3600  # the longest deadline a job may have (JobRequest.timeout_s)
ENDED_CODES = {"cancelled": "batch_cancelled", "expired": "batch_expired"}
UNANSWERED = {
    "batch_cancelled": "the batch was cancelled before this request was done",
    "batch_expired": "the batch's completion window ended before this request was done",
}


def output_file_id(batch_id: str, kind: str) -> str:
    """The id of a batch's output or error file: the same whichever gateway finalizes it."""
    return "file-" + hashlib.sha256(f"{batch_id}:{kind}".encode()).hexdigest()[:32]


class BatchDriver:
    def __init__(self, store: BatchStore, client: AsyncClient, registry: ModelRegistry, settings: GatewaySettings):
        self.store = store
        self.client = client
        self.registry = registry
        self.settings = settings
        self.holder = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.lease_ms = int(settings.batch_lease_s * 1000)
        self.runs: dict[str, asyncio.Task] = {}
        self.task: asyncio.Task | None = None
        self.budget = InFlightBudget(settings.batch_gateway_in_flight_bytes)  # shared by the batches driven here
        self.validating = asyncio.Lock()  # one batch's input file checked at a time (DrivenBatch.validate_in_turn)

    def start(self) -> None:
        self.task = asyncio.ensure_future(self._look_for_batches())

    async def stop(self) -> None:
        """Stop driving, and give the leases up: another gateway takes the batches on at once."""
        await cancel_and_wait([t for t in (self.task, *self.runs.values()) if t is not None])

    async def _look_for_batches(self) -> None:
        """Every batch_poll_s. A failure is logged once while it lasts, and its end once: each look
        logged it again, a line a second for as long as Redis was away or the index of unfinished
        batches held another type."""
        failing: str | None = None  # the last look's failure
        while True:
            try:
                for batch_id in await self.store.unfinished():
                    if batch_id not in self.runs and await self.store.take_lease(batch_id, self.holder, self.lease_ms):
                        self._drive(batch_id)
            except redis.RedisError as e:
                cause = f"{type(e).__name__}: {e}"
                if cause != failing:
                    log.warning("looking for batches to drive: %s (logged once while it lasts)", cause)
                failing = cause
            else:
                if failing is not None:
                    log.info("looking for batches to drive: Redis answers again")
                failing = None
            await asyncio.sleep(self.settings.batch_poll_s)

    def _drive(self, batch_id: str) -> None:
        log.info("batch %s: driven by %s", batch_id, self.holder)
        task = asyncio.ensure_future(DrivenBatch(self, batch_id).drive())
        self.runs[batch_id] = task
        task.add_done_callback(lambda _: self.runs.pop(batch_id, None))


Checked = tuple[int, str, str, LineRequest | APIError]  # a line's index, custom_id, request id, request


def first_hop(lines: deque[tuple[int, str]]) -> list[tuple[int, str]]:
    """The first of the (index, text) `lines`, taken off it, of at most PREPARED_APART_CHARS of
    text together (a longer line alone)."""
    hop: list[tuple[int, str]] = []
    chars = 0
    while lines and (not hop or chars + len(lines[0][1]) <= PREPARED_APART_CHARS):
        chars += len(lines[0][1])
        hop.append(lines.popleft())
    return hop


def hops_of(lines: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """(index, text) lines in hops of at most PREPARED_APART_CHARS of text (a longer line alone)."""
    rest = deque(lines)
    hops = []
    while rest:
        hops.append(first_hop(rest))
    return hops


def index_of(line: LineJobs) -> int:
    """A line's place in its batch, from 0 (LineRequest.line counts from 1)."""
    return line.request.line - 1


class DrivenBatch:
    """One gateway driving one batch while it holds the batch's lease."""

    def __init__(self, driver: BatchDriver, batch_id: str):
        self.driver = driver
        self.store = driver.store
        self.client = driver.client
        self.batch_id = batch_id
        settings = driver.settings
        self.flight = Flight(
            driver.client.keys, settings.batch_in_flight, lambda line: 1, settings.batch_in_flight_bytes
        )
        self.total = 0
        self.next_line: int | None = None  # None until the run has taken the batch's progress on
        # The lines read from next_line up to read_to and not yet added: prepared (`ready`), whose
        # jobs did not fit yet, then as read from the batch's input (`unread`, the rest of one run).
        self.ready: deque[LineJobs] = deque()
        self.unread: deque[tuple[int, str]] = deque()
        self.read_to = 0
        self.expires_at = 0
        self.ending: str | None = None  # batch_cancelled or batch_expired once the batch is ending
        self.ttl_s = driver.settings.batch_ttl_s  # the batch's own, once read
        self.output_ttl_s = self.ttl_s  # its output files': its output_expires_after, else its own
        self.tenant: str | None = None  # its owner's, as its jobs are submitted (gateway/api_keys.py)
        self.max_jobs_bytes = settings.max_request_jobs_bytes

    async def drive(self) -> None:
        try:
            while await self.store.renew_lease(self.batch_id, self.driver.holder, self.driver.lease_ms):
                fields = await self.batch_fields()
                if not fields or not await self.step(fields):
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            # Redis away, or a bug: give the batch up; the next look for batches takes it again.
            log.exception("batch %s: driving stopped", self.batch_id)
        finally:
            self.driver.budget.leave(self.batch_id)
            await asyncio.shield(self._release())

    async def batch_fields(self) -> dict[str, str] | None:
        """The batch's hash; None for one of another type, which no step can read nor end: it
        leaves the unfinished batches, logged once (it was given up with a traceback and taken
        again every poll). Its GET stays a 500 key_of_another_type, listings leave it out."""
        try:
            return await self.store.batch_fields(self.batch_id)
        except redis.ResponseError as e:
            if not is_other_type(e):
                raise
        log.warning(
            "batch %s: its hash holds another type than MILI writes there (WRONGTYPE): no longer driven; "
            "an operator deletes it",
            self.batch_id,
        )
        await self.store.leave_unfinished(self.batch_id)
        return None

    async def _release(self) -> None:
        try:
            await self.store.release_lease(self.batch_id, self.driver.holder)
        except redis.RedisError:
            pass  # it lapses by itself

    async def step(self, fields: dict[str, str]) -> bool:
        """One step of the batch; False once it has ended."""
        status = fields["status"]
        self.expires_at = int(fields["expires_at"])
        self.ttl_s = int(fields.get("ttl_s", self.ttl_s))
        self.output_ttl_s = int(fields.get("output_ttl_s", self.ttl_s))
        self.tenant = queue_tenant(fields.get("owner"))  # its lines' job ids begin with it, ended or not
        if status in ("validating", "in_progress") and time.time() >= self.expires_at:
            await self.end(fields, "expired")
        elif status == "validating":
            await self.validate_in_turn(fields)
        elif status == "in_progress":
            await self.progress(fields)
        elif status == "cancelling":
            await self.end(fields, "cancelled")
        elif status == "finalizing":
            await self.finalize("completed")
        else:
            return False
        return True

    # -- validating ----------------------------------------------------------------------------

    async def validate_in_turn(self, fields: dict[str, str]) -> None:
        """validate, one batch at a time on this gateway: a validation holds its input file whole
        (as text, as lines, and each line parsed), up to batch_max_file_bytes, and N batches
        validated at once held N times that. A batch whose turn it is not waits a step, its lease
        renewed meanwhile."""
        try:
            await asyncio.wait_for(self.driver.validating.acquire(), READ_WAIT_S)
        except asyncio.TimeoutError:  # TimeoutError from Python 3.11 on, not on 3.10
            return
        try:
            await self.validate(fields)
        finally:
            self.driver.validating.release()

    async def validate(self, fields: dict[str, str]) -> None:
        """Check the input file whole, as OpenAI does before a batch runs: a bad line fails the
        batch (its errors name the lines). The lines are copied into the batch, which so owns
        its input whatever becomes of the file."""
        file_id = fields["input_file_id"]
        try:
            pieces = [piece async for piece in await self.store.file_text(file_id)]
        except redis.ResponseError as e:
            if not is_other_type(e):
                raise
            # No retry mends it: given up, the batch was taken again every poll, with a traceback.
            message = f"the input file {file_id}'s text holds another type than MILI writes there (WRONGTYPE)"
            return await self.fail([LineErrorBody(code="invalid_input_file", message=message)])
        if await self.store.file(file_id) is None:
            return await self.fail(
                [LineErrorBody(code="file_not_found", message=f"the input file {file_id} no longer exists")]
            )
        lines, errors = await asyncio.to_thread(
            check_lines, "".join(pieces), fields["endpoint"], self.driver.settings.batch_max_lines
        )
        if errors:
            return await self.fail([e.error() for e in errors])
        await self.store.store_input(self.batch_id, lines)
        await self.store.transition(
            self.batch_id, "validating", "in_progress", "in_progress_at", int(time.time()), total=len(lines)
        )
        log.info("batch %s: %d lines valid, in progress", self.batch_id, len(lines))

    async def fail(self, errors: list[LineErrorBody]) -> None:
        body = BatchErrors(data=errors).model_dump_json()
        await self.store.finish(self.batch_id, "failed", "failed_at", int(time.time()), self.ttl_s, errors=body)
        log.info("batch %s: failed validation: %s (line %s)", self.batch_id, errors[0].message, errors[0].line)

    # -- in progress ---------------------------------------------------------------------------

    async def progress(self, fields: dict[str, str]) -> None:
        if self.next_line is None:
            await self.take_on(fields, resubmit=True)
        await self.fill()
        if self.next_line >= self.total and self.flight.idle:
            now = int(time.time())
            if (
                await self.store.transition(self.batch_id, "in_progress", "finalizing", "finalizing_at", now)
                == "finalizing"
            ):
                await self.finalize("completed")
            return
        await self.collect()

    async def take_on(self, fields: dict[str, str], resubmit: bool) -> None:
        """Where the batch stands: the lines submitted before and not yet answered are in flight
        again (submitted again when `resubmit`: their jobs are found, or made anew if they expired)."""
        self.total = int(fields.get("total", 0))
        self.next_line = self.read_to = int(fields.get("next_line", 0))
        self.driver.budget.join(self.batch_id, self.flight)
        lines = await self.prepare(await self.read(await self.store.unanswered(self.batch_id, self.next_line)))
        if resubmit:
            for line in lines:
                self.flight.add(line)
            await self.submit()
        else:
            self.flight.resumed(lines)
        log.info(
            "batch %s: taken on at line %d of %d, %d in flight", self.batch_id, self.next_line, self.total, len(lines)
        )

    async def fill(self) -> None:
        """Add the next lines while the flight has room (`batch_in_flight` lines, and
        `batch_in_flight_bytes` of their jobs) and the gateway's budget admits them
        (`batch_gateway_in_flight_bytes`, gateway.batch.budget), and submit those due. The input
        is read a run (LINES_PER_FIELD lines) at a time into `unread`, and prepared a hop at a
        time into `ready`, where the lines that do not fit wait until earlier ones are answered:
        a batch waiting for room holds one run's text and one hop's requests, not the requests
        of every line its flight could take. The lines a full queue refused wait in the flight,
        below `next_line`: a gateway that takes the batch over finds them unanswered."""
        while True:
            while self.ready and self.admits(self.ready[0]):
                self.flight.add(self.ready.popleft())
            if self.ready or self.flight.room() == 0 or (not self.unread and self.read_to == self.total):
                break
            if not self.unread:
                run_end = min(self.total, (self.read_to // LINES_PER_FIELD + 1) * LINES_PER_FIELD)
                self.unread.extend(await self.read(list(range(self.read_to, run_end))))
                self.read_to = run_end
            self.ready.extend(await self.prepare(first_hop(self.unread)))
        next_line = self.first_not_added()
        if next_line != self.next_line:
            self.next_line = next_line
            await self.store.set_fields(self.batch_id, next_line=self.next_line)
        await self.submit()

    def first_not_added(self) -> int:
        if self.ready:
            return index_of(self.ready[0])
        return self.unread[0][0] if self.unread else self.read_to

    def admits(self, line: LineJobs) -> bool:
        """Whether the line fits the batch's flight and the gateway's budget now."""
        return self.flight.fits(line) and self.driver.budget.admits(self.batch_id, line.request.jobs_bytes)

    async def read(self, indexes: list[int]) -> list[tuple[int, str]]:
        """The input lines at `indexes`, each with its index."""
        return list(zip(indexes, await self.store.input_lines(self.batch_id, indexes)))

    async def prepare(self, lines: list[tuple[int, str]]) -> list[LineJobs]:
        """The (index, text) lines' requests, each with the queue of its model. A line whose body
        the HTTP API would refuse (or whose model no queue serves) is answered here with that error."""
        prepared: list[LineJobs] = []
        refused = []
        for index, custom_id, rid, request in await self.checked_apart(lines):
            try:
                if isinstance(request, APIError):
                    raise request
                route = await self.driver.registry.route(request.request.model)
            except APIError as e:
                refused.append((index, error_answer(custom_id, rid, e)))
                continue
            prepared.append(LineJobs(request, rid, route.queue, adapter=route.adapter))
        await self.store.answer(self.batch_id, refused)
        return prepared

    async def checked_apart(self, lines: list[tuple[int, str]]) -> list[Checked]:
        """The lines checked (`checked`) off the event loop: a line of 33,000 messages takes 0.2-0.3 s
        of CPU, in which the loop answered no other request of the gateway. They go to the thread
        that builds long jobs and parses long bodies (producer_client.aio.BUILDER: one at a time,
        since they hold the GIL), in hops of at most PREPARED_APART_CHARS of text, so that a long
        HTTP body waits behind one hop at most."""
        return [line for hop in hops_of(lines) for line in await built_apart(self.checked, hop)]

    def checked(self, lines: list[tuple[int, str]]) -> list[Checked]:
        """Each line's (index, custom_id, request id, and request or the APIError that refuses its
        body), as the HTTP API checks a body; CPU only."""
        out: list[Checked] = []
        for index, text in lines:
            line = parse_line(text, index + 1)
            rid = request_id(self.batch_id, line.custom_id, line.body, self.tenant)
            try:
                out.append((index, line.custom_id, rid, line_request(line, index + 1, self.max_jobs_bytes)))
            except APIError as e:
                out.append((index, line.custom_id, rid, e))
        return out

    async def submit(self) -> None:
        """Enqueue the jobs of the lines due, each queue's in one submit_many, as the batch's owner
        (flex unless a line names its tier: its share, quota and rate limits)."""
        timeout_s = min(MAX_JOB_TIMEOUT_S, max(1.0, self.expires_at - time.time()))
        for queue, lines in self.flight.due().items():
            try:
                await (
                    self.client.on_queue(queue)
                    .as_tenant(self.tenant)
                    .submit_many([spec for line in lines for spec in line.submit_specs(timeout_s=timeout_s)])
                )
            except REFUSALS as refused:
                waiting = self.flight.submitted(lines, refused)
                why = f"queue {queue!r} is full" if isinstance(refused, BulkQueueFull) else str(refused)
                log.info("batch %s: %s; line %d waits", self.batch_id, why, index_of(waiting[0]))
            else:
                self.flight.submitted(lines)

    async def collect(self) -> None:
        """Answer the lines whose jobs have all ended since the last step."""
        if not self.flight.watch:
            await self.driver.budget.wait(self.batch_id, READ_WAIT_S)
            return
        results = await self.client.finished(self.flight.watch, timeout=READ_WAIT_S)
        ended = self.flight.ended(results)
        if ended:
            self.driver.budget.freed()
        await self.store.answer(self.batch_id, [(index_of(line), self.answer(line)) for line in ended])

    def answer(self, line: LineJobs) -> OutputLine:
        results = line.in_choice_order()
        code = self.unanswered_code(results)
        if code is not None:
            return unanswered(line.request.custom_id, line.request_id, code, UNANSWERED[code])
        return answer(line.request, line.request_id, results)

    def unanswered_code(self, results: list) -> str | None:
        """batch_expired for a job past its deadline (the window's end), the batch's ending code
        for a job it cancelled; None for a line answered as the HTTP API would answer it."""
        if any(r.status == "expired" or r.finish_reason == "timeout" for r in results):
            return "batch_expired"
        if self.ending is not None and any(r.status == "cancelled" for r in results):
            return self.ending
        return None

    # -- ending --------------------------------------------------------------------------------

    async def end(self, fields: dict[str, str], final: str) -> None:
        """Cancelled, or past its window: the jobs in flight are cancelled and given
        CANCEL_GRACE_S to end; what ended is answered as it ended, every other line as not done."""
        self.ending = ENDED_CODES[final]
        self.driver.budget.give_up_turn(self.batch_id)  # it adds no line any more
        if self.next_line is None:
            await self.take_on(fields, resubmit=False)
        await self.client.cancel_many(self.flight.jobs_out())
        grace_until = time.monotonic() + CANCEL_GRACE_S
        while self.flight.jobs_out() and time.monotonic() < grace_until:
            if not await self.store.renew_lease(self.batch_id, self.driver.holder, self.driver.lease_ms):
                return
            await self.collect()
        await self.give_up_unanswered()
        await self.finalize(final)
        log.info("batch %s: %s", self.batch_id, final)

    async def give_up_unanswered(self) -> None:
        indexes = await self.store.unanswered(self.batch_id, self.total)
        for start in range(0, len(indexes), 1000):
            page = indexes[start : start + 1000]
            texts = await self.store.input_lines(self.batch_id, page)
            answers = []
            for index, text in zip(page, texts):
                line = parse_line(text, index + 1)
                rid = request_id(self.batch_id, line.custom_id, line.body, self.tenant)
                answers.append((index, unanswered(line.custom_id, rid, self.ending, UNANSWERED[self.ending])))
            await self.store.answer(self.batch_id, answers)

    async def finalize(self, final: str) -> None:
        """The answers into the output and error files, then the batch's final status."""
        now = int(time.time())
        files = {}
        owner = await self.store.batch_owner(self.batch_id)  # the output files are the batch's owner's
        for ok, kind, name in ((True, "output", "output_file_id"), (False, "errors", "error_file_id")):
            file = await self.store.put_file(
                output_file_id(self.batch_id, kind),
                f"{self.batch_id}_{kind}.jsonl",
                "batch_output",
                self.pieces(ok),
                now,
                self.output_ttl_s,
                owner,
            )
            if file is not None:
                files[name] = file.id
        await self.store.finish(self.batch_id, final, f"{final}_at", now, self.ttl_s, **files)

    async def pieces(self, ok: bool) -> AsyncIterator[str]:
        pieces = Pieces()
        async for page in self.store.answers(self.batch_id, ok):
            for text in page:
                if (piece := pieces.add(text + "\n")) is not None:
                    yield piece
        if (last := pieces.rest()) is not None:
            yield last
