"""Many jobs at once, for the sync and asyncio clients alike. No I/O here (as in operations.py): the
clients run the same steps over their own connections.

- `submit_many` validates every spec before anything is sent, then enqueues the jobs in chunks of
  CHUNK, at most three pipelined round trips a chunk whatever its size: CREATE for the jobs that
  carry a request_id (only those not seen before go on), then the others' CREATE with one
  ENQUEUE_MANY (ENQUEUE_LANES for lanes and tenants) of the whole chunk, then the request_ids'
  `enqueued` flags. Each stream's bound and the tenant's limits hold as for `submit`: a chunk that
  would cross them goes in up to them, and BulkQueueFull (or WaitingQuotaExceeded, RateLimited)
  names what went in.
- `ResultWatch` holds the jobs a caller waits for; one XREAD of their `done` streams returns every
  one of them that has ended, or blocks until one does (on a cluster, see `read_finished`); a job
  that ended longer ago than its done stream lives is found in its hash (ResultWatch.to_look).
  `as_completed` yields them batch by batch (`watch_all`, then `next_finished` until none is left),
  `results` collects them alike, `take_finished` serves callers that add jobs as they go.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, NamedTuple, TypeVar

from redis.exceptions import NoPermissionError

from producer_client.client_base import ClientBase
from producer_client.cluster import is_cluster
from producer_client.connection import is_other_type
from producer_client.errors import (
    BulkQueueFull,
    IdempotencyConflict,
    InvalidArgument,
    InvalidJob,
    JobNotFound,
    JobTimeout,
    MiliError,
)
from producer_client.keys import DONE_TTL_MS, NO_TENANT, Keys
from producer_client.new_job import KnownParams, NewJob, build_job_of
from producer_client.operations import cancel_call
from producer_client.placement import Placement
from producer_client.protocol import job_reads
from producer_client.protocol import producer as scripts
from producer_client.protocol.clock import RedisTime, entry_order
from producer_client.protocol.execution import AddCommands, Pipe
from producer_client.protocol.job_reads import Entry, StatusAndDeadline
from producer_client.protocol.producer import NO_LIMITS, Limits
from producer_client.protocol.replies import Enqueued, Refusal, UnknownReply, parse_enqueue, parse_enqueue_many
from producer_client.protocol.script import add_all
from producer_client.protocol.shards import ONE_SHARD, QueueShards
from producer_client.schema import JobExpired, JobResult, Timings, invalid_job_result, parse_result
from producer_client.sharing import (
    lane_job,
    placed_fields,
    refusal_error,
    refuse_queue_stream_of_another_type,
    uses_queue_stream,
)
from producer_client.steps import Steps, checked, undoing
from producer_client.validation import check_job_ids, check_timeout
from producer_client.waiting import Deadline, expiry, streams_read

CHUNK = 1000  # jobs per pipelined chunk: one ENQUEUE_MANY holds Redis for about a millisecond
WINDOW = 512  # `done` streams per XREAD
# On a cluster a blocking read waits on one job's `done` stream; the window's others are looked
# at again this often.
CLUSTER_BLOCK_MS = 100
# What a job is, one of whose keys holds another type (WRONGTYPE), as status_reads.of_job says it.
OTHER_TYPE = "a key of it holds a value of another type than its own"
R = TypeVar("R")


def listed_specs(specs: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """submit_many's specs as a list. One spec alone (a dict: its keys would be the specs) or what
    is no iterable (None: a TypeError) is refused as `jobs`."""
    if isinstance(specs, (str, bytes, Mapping)) or not isinstance(specs, Iterable):
        raise InvalidArgument("jobs", "must be a list of dicts of submit()'s keyword arguments (one alone: wrap it)")
    return list(specs)


def build_jobs(specs: Iterable[Mapping[str, Any]], tenant: str | None = None) -> list[NewJob]:
    """Every spec validated as `submit` validates its arguments; InvalidArgument names the first
    bad one as `jobs[<index>].<field>`."""
    known_params: KnownParams = {}
    jobs = [build_spec(index, spec, known_params, tenant) for index, spec in enumerate(listed_specs(specs))]
    refuse_a_request_id_bound_twice(jobs)
    return jobs


def refuse_a_request_id_bound_twice(jobs: list[NewJob]) -> None:
    """A request_id given twice in one call with two requests is IdempotencyConflict, before anything
    is sent, as a later call's would be: else the second spec's id would answer with the first's job."""
    bound: dict[str, str] = {}
    for job in jobs:
        if job.idempotent and bound.setdefault(job.job_id, job.fingerprint) != job.fingerprint:
            raise IdempotencyConflict(job.job_id)


def build_spec(
    index: int, spec: Mapping[str, Any], known_params: KnownParams | None = None, tenant: str | None = None
) -> NewJob:
    if not isinstance(spec, Mapping):
        raise InvalidArgument(f"jobs[{index}]", "must be a dict of submit()'s keyword arguments")
    try:
        return build_job_of(spec, known_params=known_params, tenant=tenant)
    except InvalidArgument as e:
        raise e.named(f"jobs[{index}].{e.field}") from None


def submit_many(client: ClientBase, specs: Iterable[Mapping[str, Any]]) -> Steps[list[str]]:
    """Client.submit_many: every spec validated first (build_jobs), then the jobs enqueued."""
    return (yield from submit_built(client, build_jobs(specs, client.tenant)))


def submit_built(client: ClientBase, jobs: list[NewJob]) -> Steps[list[str]]:
    """`jobs`, validated already (build_jobs), enqueued on the client's queue, in their lanes of the
    client's tenant (submit_steps)."""
    if client.shards.spreads:
        yield from client.shards.agree(client.keys, client.queue)
    limits = yield from client.quota_cache.limits_for(client.keys, client.tenant)
    keys, tenant, one_server = client.keys, client.tenant_name, not is_cluster(client.redis)
    # A tenant with limits enqueues on shard 0 only, where they are counted as one (operations.py).
    shards = QueueShards() if limits.any else client.shards
    steps = submit_steps(
        keys, client.queue, client.max_queue_depth, jobs, client.placement, tenant, limits, one_server, shards
    )
    return (yield from steps)


def submit_steps(
    keys: Keys,
    queue: str,
    max_depth: int | None,
    jobs: list[NewJob],
    placement: Placement,
    tenant: str = NO_TENANT,
    limits: Limits = NO_LIMITS,
    one_server: bool = False,
    shards: QueueShards = ONE_SHARD,
) -> Steps[list[str]]:
    """Enqueue `jobs` chunk by chunk; returns their ids in order (`one_server`: not a cluster, so
    that one CREATE_MANY creates a chunk's jobs of fresh ids). Specs with the same request_id
    are one job. Raises BulkQueueFull when a stream fills up part-way, WaitingQuotaExceeded or
    RateLimited when the tenant's limits stop it; whatever MiliError stops it (those, and
    InvalidQueueStream, IdempotencyConflict, RedisUnavailable...) names in `job_ids` the ids of the
    specs enqueued (WentIn.ids_of); UnknownAdapter, before any goes in, for an adapter no live
    worker of the queue serves."""
    yield from placement.check_adapters(keys, queue, [job.adapter for job in jobs])
    unique: dict[str, NewJob] = {}
    for job in jobs:
        unique.setdefault(job.job_id, job)
    went = WentIn(shards.count_of(queue))
    try:
        for into, chunk in shard_chunks(queue, list(unique.values()), shards):
            sent = yield from enqueue_chunk(keys, queue, max_depth, chunk, placement, tenant, limits, one_server, into)
            went.add(sent)
            refusal = None
            if sent.refused:
                refusal = chunk_refusal(sent, queue, tenant, max_depth, went.ids_of(jobs))
            yield from flag_chunk(keys, sent, refusal)
            if refusal is not None:
                raise refusal
    except MiliError as stopped:
        if stopped.job_ids is None:  # not a chunk's refusal, which names them already
            stopped.job_ids = went.ids_of(jobs)
        raise
    return [job.job_id for job in jobs]


class WentIn:
    """What submit_many's chunks put in so far: `in_queue`, the ids of their jobs in the queue (found
    there already or enqueued); `enqueued`, those the call enqueued; over `shard_count` shards."""

    def __init__(self, shard_count: int):
        self.in_queue: set[str] = set()
        self.enqueued: set[str] = set()
        self.shard_count = shard_count

    def add(self, sent: ChunkSent) -> None:
        self.in_queue.update(sent.in_queue)
        self.enqueued.update(job.job_id for job in sent.enqueued)

    def ids_of(self, jobs: list[NewJob]) -> list[str]:
        """The ids of the specs enqueued, in order, as an error of submit_many names them. On one
        shard: those before the first spec not in the queue (a prefix, so that submitting the
        specs after it again carries on; a job found there already past it is not named), and any
        later one this call enqueued: a job placed on a worker's stream that went in after one
        the shared route refused (enqueue_placed), whose entry is in, and which no later submit
        must lose. On several shards, where each shard's chunks go in turn: every spec in the
        queue."""
        ids = [job.job_id for job in jobs]
        if self.shard_count > 1:
            return [job_id for job_id in ids if job_id in self.in_queue]
        first_out = next((i for i, job_id in enumerate(ids) if job_id not in self.in_queue), len(ids))
        return ids[:first_out] + [job_id for job_id in ids[first_out:] if job_id in self.enqueued]


def chunk_refusal(sent: ChunkSent, queue: str, tenant: str, max_depth: int | None, done: list[str]) -> Exception:
    """The error of a chunk some of whose jobs did not go in, naming `done`, the specs enqueued: what
    stopped its placed jobs (enqueue_placed) first, which asking again will not mend where it is
    a stream of another type; else its lanes' refusal."""
    if sent.stopped is not None:
        if isinstance(sent.stopped, MiliError):
            sent.stopped.job_ids = done
        return sent.stopped
    outcome = sent.outcome
    if outcome.refusal is Refusal.FULL:
        return BulkQueueFull(queue, int(outcome.values[0]), max_depth or 0, done)
    error = refusal_error(outcome, queue, tenant, max_depth, done)
    # Fewer jobs went in than were sent: the reply must say why.
    return error if error is not None else UnknownReply("ENQUEUE_MANY or ENQUEUE_LANES", outcome)


def shard_chunks(queue: str, jobs: list[NewJob], shards: QueueShards) -> Iterator[tuple[str, list[NewJob]]]:
    """(the name of the shard's keys, a chunk of at most CHUNK jobs bound for it), shard by shard:
    one pipeline per chunk, so each goes to its shard's node alone."""
    by_shard = {queue: jobs}
    if shards.count_of(queue) > 1:
        by_shard = {}
        for job in jobs:
            by_shard.setdefault(shards.name_for(queue, job.job_id), []).append(job)
    for into, bound in by_shard.items():
        for start in range(0, len(bound), CHUNK):
            yield into, bound[start : start + CHUNK]


def enqueue_chunk(
    keys: Keys,
    queue: str,
    max_depth: int | None,
    chunk: list[NewJob],
    placement: Placement,
    tenant: str,
    limits: Limits,
    one_server: bool,
    into: str,
) -> Steps[ChunkSent]:
    """What went in of the chunk and what did not (ChunkSent), the flags and the refused jobs'
    hashes left to `flag_chunk`. A job whose enqueue fails or does not go in loses its hash, as
    in `submit`: a later submit with its request_id then enqueues it. Jobs placed on workers' own
    streams (which have no bound) go in once the lanes have taken their part, and only those
    before the first job refused. What stops a placed job (enqueue_placed) stops it alone: one
    placed that went in keeps its hash, and is named as enqueued. A tenant with limits places
    nothing: its jobs all go through the lanes, where the limits are counted. `into`: the name of
    the shard's keys the chunk's lane jobs go to (`queue` itself on one shard)."""
    found = yield from found_already(keys, [job for job in chunk if job.idempotent])
    to_add = [job for job in chunk if job.job_id not in found]
    if not to_add:
        return ChunkSent([job.job_id for job in chunk], [], [], Enqueued(len(chunk)))
    streams: list[str | None]
    if limits.any:
        streams = [None] * len(to_add)
    else:
        streams = yield from placement.streams_for(keys, queue, [job.prefix for job in to_add])
    shared = [job for job, stream in zip(to_add, streams) if stream is None]
    replies: list[Any] = []
    try:
        replies = yield enqueue_commands(keys, into, max_depth, to_add, shared, tenant, limits, one_server)
        if shared:
            refuse_queue_stream_of_another_type(replies[-1], queue, shared, tenant)
        checked(replies)
    except Exception as stopped:
        written = maybe_written(to_add, replies, one_server)
        if written:
            yield from undoing(forget_commands(written, keys), stopped)
        raise
    outcome = chunk_outcome(replies[-1], shared, tenant) if shared else Enqueued(0)
    cut = to_add.index(shared[outcome.added]) if outcome.added < len(shared) else len(to_add)
    placed = [(job, stream) for job, stream in zip(to_add[:cut], streams) if stream is not None]
    missed = (
        (yield from enqueue_placed(keys, queue, into, placed, placement, tenant, limits, one_server))
        if placed
        else NONE_MISSED
    )
    out = {job.job_id for job in missed.jobs}
    enqueued = [job for job in to_add[:cut] if job.job_id not in out]
    in_queue = found | {job.job_id for job in enqueued}
    return ChunkSent(
        [job.job_id for job in chunk if job.job_id in in_queue],
        enqueued,
        missed.jobs + to_add[cut:],
        outcome,
        missed.error,
    )


class ChunkSent(NamedTuple):
    """A chunk's enqueue: `in_queue`, the ids of its jobs in the queue now (found there or enqueued),
    in order; `enqueued`, the jobs this call enqueued; `refused`, those it created and did not
    enqueue; the lanes' `outcome`; `stopped`, what stopped placed jobs (enqueue_placed; None: none
    was)."""

    in_queue: list[str]
    enqueued: list[NewJob]
    refused: list[NewJob]
    outcome: Enqueued
    stopped: Exception | None = None


def flag_chunk(keys: Keys, sent: ChunkSent, refusal: Exception | None) -> Steps[None]:
    """One round trip: the `enqueued` flags of the chunk's jobs with a request_id, and no hash of
    those refused. Where some were refused, a failure of it is logged and `refusal` is what the
    caller raises (steps.undoing, as a single refused submit): the user must learn which jobs
    went in and why the others did not. Then a refused job's hash stays (status: queued), and a
    job enqueued stays unflagged: a later submit of either's request_id enqueues it (CREATE finds
    it unflagged), once more for the second, which CLAIM drops."""
    if refusal is not None:
        yield from undoing(flag_commands(keys, sent.enqueued, sent.refused), refusal)
    elif any(job.idempotent for job in sent.enqueued):
        checked((yield flag_commands(keys, sent.enqueued, [])))


class Missed(NamedTuple):
    """Placed jobs that did not go in, or may not have (their round trip failed), and the error that
    stopped the first of them (None: none did)."""

    jobs: list[NewJob]
    error: Exception | None


NONE_MISSED = Missed([], None)


def enqueue_placed(
    keys: Keys,
    queue: str,
    into: str,
    placed: list[tuple[NewJob, str]],
    placement: Placement,
    tenant: str,
    limits: Limits,
    one_server: bool,
) -> Steps[Missed]:
    """The placed jobs' XADDs; returns those that did not go in, and why. Those whose worker's
    stream a producer made another type go to the shared route instead (enqueue_elsewhere), the
    view read again. Whatever stops some, one whose XADD went in is not among them: its entry is in
    its worker's stream, which will run it, and it keeps its hash. A round trip that failed as a
    whole may have added any of them: they all lose their hash, as a submit's job does."""
    jobs = [job for job, _ in placed]
    try:
        replies = yield enqueue_placed_commands(placed, tenant)
    except Exception as stopped:
        return Missed(jobs, stopped)
    errors = [(job, reply) for job, reply in zip(jobs, replies) if isinstance(reply, Exception)]
    elsewhere = [job for job, reply in errors if is_other_type(reply)]
    failed = [(job, reply) for job, reply in errors if not is_other_type(reply)]
    missed = Missed([job for job, _ in failed], failed[0][1] if failed else None)
    if not elsewhere:
        return missed
    placement.forget_view(queue)
    more = yield from enqueue_elsewhere(keys, queue, into, elsewhere, tenant, limits, one_server)
    return Missed(missed.jobs + more.jobs, missed.error or more.error)


def enqueue_elsewhere(
    keys: Keys, queue: str, into: str, jobs: list[NewJob], tenant: str, limits: Limits, one_server: bool
) -> Steps[Missed]:
    """`jobs`, whose placed XADDs met their worker's stream of another type (operations.placed_elsewhere),
    on the shared route, without a bound, as a placed entry has none: a job admitted by its
    placement is not refused after it. Returns those it did not take and why: a stream of the
    route of another type (InvalidQueueStream), or a round trip that failed."""
    try:
        replies = yield enqueue_commands(keys, into, None, [], jobs, tenant, limits, one_server)
        refuse_queue_stream_of_another_type(replies[-1], queue, jobs, tenant)
        outcome = chunk_outcome(checked(replies)[-1], jobs, tenant)
    except Exception as stopped:
        return Missed(jobs, stopped)
    if outcome.added == len(jobs):
        return NONE_MISSED
    error = refusal_error(outcome, queue, tenant, None)
    return Missed(jobs[outcome.added :], error or UnknownReply("ENQUEUE_MANY or ENQUEUE_LANES", outcome))


def chunk_outcome(reply: object, shared: list[NewJob], tenant: str) -> Enqueued:
    """ENQUEUE_MANY's {jobs added, depth after} or ENQUEUE_LANES's reply, as an outcome."""
    if not uses_queue_stream(shared, tenant):
        return parse_enqueue(reply)
    added, depth = parse_enqueue_many(reply)
    return Enqueued(added, Refusal.FULL if added < len(shared) else Refusal.NONE, (depth, ""))


def found_already(keys: Keys, idempotent: list[NewJob]) -> Steps[set[str]]:
    """The ids of the jobs that CREATE found in the queue already, or past it. A request_id of
    another request raises IdempotencyConflict, once the hashes this call created are gone again
    (nothing of the chunk is enqueued); a clean-up that fails is logged, and the conflict raised."""
    if not idempotent:
        return set()
    replies = checked((yield add_all([job.create_call(keys) for job in idempotent])))
    conflict = next((job for job, reply in zip(idempotent, replies) if reply == -1), None)
    if conflict is not None:
        error = IdempotencyConflict(conflict.job_id)
        created = [job for job, reply in zip(idempotent, replies) if reply == 1]
        if created:
            yield from undoing(forget_commands(created, keys), error)
        raise error
    return {job.job_id for job, reply in zip(idempotent, replies) if not job.created(reply)}


def enqueue_commands(
    keys: Keys,
    queue: str,
    max_depth: int | None,
    jobs: list[NewJob],
    shared: list[NewJob],
    tenant: str,
    limits: Limits,
    one_server: bool = False,
) -> AddCommands:
    """The hashes of the jobs with a fresh id (CREATE of the others went first): on `one_server`
    one CREATE_MANY, else a command each; then one call for those bound for the lanes:
    ENQUEUE_MANY when they all go to the queue's own stream (the default lane, no tenant), else
    ENQUEUE_LANES, which also counts the tenant's limits."""

    def add(pipe: Pipe) -> None:
        fresh = [job for job in jobs if not job.idempotent]
        if one_server and fresh:
            scripts.create_many(keys, [(job.job_id, job.timeout_ms) for job in fresh]).add_to(pipe)
        else:
            for job in fresh:
                scripts.add_fresh_create(pipe, keys, job.job_id, job.timeout_ms)
        if not shared:
            return
        if uses_queue_stream(shared, tenant):
            pairs = [(job.job_id, job.body) for job in shared]
            scripts.enqueue_many(keys.queue(queue), max_depth or 0, pairs).add_to(pipe)
        else:
            scripts.enqueue_lanes(
                keys, queue, tenant, [lane_job(job) for job in shared], max_depth or 0, limits
            ).add_to(pipe)

    return add


def enqueue_placed_commands(placed: list[tuple[NewJob, str]], tenant: str) -> AddCommands:
    """An XADD per job placed on a worker's stream, which has no bound (see sharing.enqueue_call),
    with its route and cost (only lane-aware workers take placed jobs)."""

    def add(pipe: Pipe) -> None:
        for job, stream in placed:
            scripts.add_placed(pipe, stream, job.job_id, job.body, placed_fields(job, tenant))

    return add


def flag_commands(keys: Keys, enqueued: list[NewJob], refused: list[NewJob]) -> AddCommands:
    """The `enqueued` flag of the jobs with a request_id now in the queue (only a later submit of
    the same request_id reads it: a fresh id has none), and no hash of a job that did not fit."""

    def add(pipe: Pipe) -> None:
        for job in enqueued:
            if job.idempotent:
                scripts.add_enqueued_flag(pipe, keys, job.job_id)
        if refused:
            scripts.add_forget(pipe, keys, [job.job_id for job in refused])

    return add


def maybe_written(jobs: list[NewJob], replies: list[Any], one_server: bool) -> list[NewJob]:
    """The jobs whose hash an enqueue_commands pipeline of `jobs` that failed may have written: all
    but the fresh ones whose CREATE the ACL refused (its replies come first, one CREATE_MANY on
    one server), which wrote nothing and whose DEL it refuses too: that refusal was logged as a
    clean-up that failed, a second line from mili."""
    fresh = [job for job in jobs if not job.idempotent]
    creates = replies[:1] * len(fresh) if one_server else replies[: len(fresh)]
    refused = {job.job_id for job, reply in zip(fresh, creates) if isinstance(reply, NoPermissionError)}
    return [job for job in jobs if job.job_id not in refused]


def forget_commands(jobs: list[NewJob], keys: Keys) -> AddCommands:
    return lambda pipe: scripts.add_forget(pipe, keys, [job.job_id for job in jobs])


def cancel_many(keys: Keys, job_ids: Iterable[str]) -> Steps[None]:
    """CANCEL of each job in one pipeline; then InvalidJob names the first job one of whose keys
    holds another type (its CANCEL wrote nothing), the others cancelled."""
    job_ids = check_job_ids(job_ids)
    if job_ids:
        _, _, invalid = split_invalid(job_ids, (yield cancel_commands(keys, job_ids)))
        if invalid:
            raise InvalidJob(invalid[0], OTHER_TYPE)


def split_invalid(job_ids: Sequence[str], replies: Sequence[R | Exception]) -> tuple[list[str], list[R], list[str]]:
    """(the jobs that replied, their replies, the jobs whose reply is WRONGTYPE): a key of such a
    job holds another type (a producer may write one), an error of that job alone, which leaves
    the others' replies good. Any other error is raised, as `checked` raises it."""
    good_ids, good, invalid = [], [], []
    for job_id, reply in zip(job_ids, replies):
        if not isinstance(reply, Exception):
            good_ids.append(job_id)
            good.append(reply)
        elif is_other_type(reply):
            invalid.append(job_id)
        else:
            raise reply
    return good_ids, good, invalid


def cancel_commands(keys: Keys, job_ids: list[str]) -> Callable[[Any], None]:
    """CANCEL of each job, in one pipeline."""
    return add_all([cancel_call(keys, job_id) for job_id in job_ids])


class ResultWatch:
    """The jobs a caller waits for, in the order they were added (an id added twice is one job).

    A read looks at the `done` streams of the first WINDOW of them: one XREAD returns every one
    of those that has ended, or blocks until one does, so collecting many results costs a round
    trip per batch of them, not per job, and Redis's work per read is bounded whatever the number
    of jobs watched. A queue is FIFO, so the earliest jobs are the ones that end first; a later
    one that ends sooner is returned once those before it leave the window.

    A done stream lives DONE_TTL_MS after its job's end: a job that ended before it came into the
    window, or while the caller left the watch unread for longer than that, is found by a look at
    its hash's result instead (to_look). Each job of the window is looked at again once its last
    look is half that old, whatever the reads did meanwhile: a read whose reply held a job's entry
    and was lost (a connection cut under it, the read retried after the stream went) then costs
    that job half the stream's life, not the rest of the wait."""

    def __init__(self, keys: Keys, job_ids: Iterable[str] = ()):
        self.keys = keys
        self.waiting: dict[str, None] = dict.fromkeys(check_job_ids(job_ids))
        self.looked: dict[str, float] = {}  # job -> when a look at its hash last returned (monotonic)
        # When each job that was queued with a deadline expires unread (monotonic): as_completed
        # yields it as expired then, since no worker will start it (see watch_all).
        self.expiries: dict[str, float] = {}
        self.ready: list[JobResult] = []  # results known before any read (watch_all): the next's

    def __len__(self) -> int:
        return len(self.waiting) + len(self.ready)

    def drop_invalid(self, job_ids: Iterable[str]) -> list[JobResult]:
        """Jobs one of whose keys holds another type, out of the watch: each is its failure with
        `invalid_job` (InvalidJob's), which ends its wait alone."""
        results = []
        for job_id in job_ids:
            if job_id in self.waiting:
                del self.waiting[job_id]
                self.looked.pop(job_id, None)
                self.expiries.pop(job_id, None)
                results.append(invalid_job_result(InvalidJob(job_id, OTHER_TYPE)))
        return results

    def take_ready(self) -> list[JobResult]:
        ready, self.ready = self.ready, []
        return ready

    def add(self, job_ids: Iterable[str]) -> None:
        self.waiting.update(dict.fromkeys(check_job_ids(job_ids)))

    def first(self) -> str:
        return next(iter(self.waiting))

    def window(self) -> dict[str, str]:
        """The first WINDOW jobs' `done` streams: stream key -> job id."""
        return {self.keys.done(job_id): job_id for job_id in islice(self.waiting, WINDOW)}

    def to_look(self, window: dict[str, str], every: bool) -> list[str]:
        """The jobs of `window` whose hash the next read looks at first: all of them (`every`), or
        those new in the window and those whose last look is half a done stream's life old."""
        if every:
            self.looked.clear()
        looked_since = time.monotonic() - DONE_TTL_MS / 2000
        return [job_id for job_id in window.values() if self.looked.get(job_id, -float("inf")) < looked_since]

    def take_looked(self, job_ids: list[str], results: list[str | None]) -> list[JobResult]:
        """The results a look at `job_ids`' hashes found (None: not ended), out of the watch, in
        the order the jobs ended."""
        self.looked.update(dict.fromkeys(job_ids, time.monotonic()))
        ended = []
        for job_id, data in zip(job_ids, results):
            if data is not None:
                del self.looked[job_id]
                del self.waiting[job_id]
                self.expiries.pop(job_id, None)
                ended.append(parse_result(job_id, data))
        return sorted(ended, key=lambda result: result.timings.finished_at or 0.0)

    def take(self, window: dict[str, str], reply: list[tuple[str, list[Entry]]]) -> list[JobResult]:
        """The results in an XREAD reply over `window`, in the order the jobs ended (their `done`
        entries' ids: Redis's clock, to the millisecond), out of the watch from now on. A failed
        job's result is returned like any other: one job's failure ends no wait."""
        ended = []
        for key, ((entry_id, fields),) in reply:
            del self.waiting[window[key]]
            self.looked.pop(window[key], None)
            self.expiries.pop(window[key], None)
            ended.append((entry_order(entry_id), window[key], fields.get("data")))
        return [parse_result(job_id, data) for _, job_id, data in sorted(ended)]

    def next_expiry(self) -> float | None:
        return min(self.expiries.values(), default=None)

    def due(self) -> list[str]:
        """The jobs whose deadline has passed by this process's clock, for Redis to confirm."""
        now = time.monotonic()
        return [job_id for job_id, at in self.expiries.items() if at <= now]

    def expect(self, job_ids: list[str], looks: list[StatusAndDeadline], redis_time: RedisTime) -> None:
        """When each of `job_ids` expires unread, from its status and deadline and Redis's TIME
        (job_reads.deadlines): at once for one past it already; never for one that started or ended."""
        for job_id, at, _ in expiries(job_ids, looks, redis_time):
            if at is not None:
                self.expiries[job_id] = at

    def expired(self, job_ids: list[str], looks: list[StatusAndDeadline], redis_time: RedisTime) -> list[JobResult]:
        """Of `job_ids`, read again as `expect` reads them: the expired results of those still
        queued past their deadline, out of the watch; the others' expiries as they now stand."""
        results = []
        for job_id, at, deadline_ms in expiries(job_ids, looks, redis_time):
            if at == PASSED and deadline_ms is not None:  # only a deadline passes
                del self.waiting[job_id], self.expiries[job_id]
                self.looked.pop(job_id, None)
                results.append(expired_result(job_id, int(deadline_ms)))
            elif at is None:
                self.expiries.pop(job_id, None)
            else:
                self.expiries[job_id] = at
        return results


PASSED = 0.0  # the expiry of a job past its deadline: due at once


def expiries(
    job_ids: list[str], looks: list[StatusAndDeadline], redis_time: RedisTime
) -> Iterator[tuple[str, float | None, str | None]]:
    """Each job's expiry as `waiting.expiry` has it (PASSED for one past its deadline), and its
    deadline, from its status and deadline as job_reads.deadlines read them."""
    for job_id, (status, deadline_ms) in zip(job_ids, looks):
        try:
            yield job_id, expiry(job_id, status, deadline_ms, redis_time), deadline_ms
        except JobExpired:
            yield job_id, PASSED, deadline_ms


def expired_result(job_id: str, deadline_ms: int) -> JobResult:
    """The result of a job that passed its deadline unread, before a worker writes it: the same,
    but for the worker's name and when it was queued, which only its entry tells."""
    return JobResult(id=job_id, status="expired", timings=Timings(finished_at=deadline_ms / 1000))


def read_finished(watch: ResultWatch, block_ms: int, per_slot: bool) -> Steps[list[JobResult]]:
    """The results of the watched jobs that have ended, out of `watch`: first a look at the hashes
    of those the watch names (ResultWatch.to_look), which returns what it finds; else one XREAD of
    the window's `done` streams, which returns at once with every one that has an entry, else
    blocks up to `block_ms` for the first. `per_slot` (a cluster): one XREAD reads the streams of
    one slot only, and a window's jobs lie in about as many slots as there are jobs; so every read
    looks at the window's hashes in one round trip, and if none has ended, a read blocks on the
    first job's done stream (the oldest: a queue ends its jobs about in order) for at most
    CLUSTER_BLOCK_MS, so that a later job that ends first waits no longer than that."""
    window = watch.window()
    to_look = watch.to_look(window, per_slot)
    if to_look:
        replies = yield from job_reads.fields_of_jobs(watch.keys, to_look, "result")
        to_look, results, invalid = split_invalid(to_look, replies)
        ended = watch.drop_invalid(invalid) + watch.take_looked(to_look, results)
        if ended:
            return ended
    if per_slot:
        first = next(iter(window))
        window, block_ms = {first: window[first]}, min(block_ms, CLUSTER_BLOCK_MS)
    (reply,) = yield lambda pipe: job_reads.add_ends_read(pipe, window, block_ms)
    if is_other_type(reply):
        return (yield from done_of_another_type(watch, window))
    return watch.take(window, streams_read(reply))


def done_of_another_type(watch: ResultWatch, window: dict[str, str]) -> Steps[list[JobResult]]:
    """An XREAD of `window`'s done streams met one of another type, which fails the whole read: an
    XLEN of each finds which, and each is its job's InvalidJob, out of the watch (the others are
    read again next)."""
    replies = yield lambda pipe: job_reads.add_done_types(pipe, window)
    _, _, invalid = split_invalid(list(window.values()), replies)
    return watch.drop_invalid(invalid)


def watch_all(keys: Keys, job_ids: Iterable[str], timeout: float | None) -> Steps[tuple[ResultWatch, Deadline]]:
    """as_completed()'s start: the watch of `job_ids`, with when each job still queued expires
    unread, and the deadline of the whole wait. Raises JobNotFound for an id with no job (no
    status), JobExpired for none: a job expired already is yielded as such by the first read."""
    job_ids = check_job_ids(job_ids)
    deadline = Deadline("", check_timeout(timeout))
    watch = ResultWatch(keys, job_ids)
    for start in range(0, len(job_ids), CHUNK):
        replies, redis_time = yield from job_reads.deadlines(keys, job_ids[start : start + CHUNK])
        chunk, looks, invalid = split_invalid(job_ids[start : start + CHUNK], replies)
        watch.ready += watch.drop_invalid(invalid)
        missing = next((job_id for job_id, (status, _) in zip(chunk, looks) if status is None), None)
        if missing is not None:
            raise JobNotFound(missing)
        watch.expect(chunk, looks, redis_time)
    return watch, deadline


def next_finished(watch: ResultWatch, deadline: Deadline, per_slot: bool) -> Steps[list[JobResult]]:
    """as_completed()'s next batch (read_finished), with the jobs that expired unread (their
    deadline passed, which Redis confirms, before a worker read them): [] if none ended within a
    bounded read, which ends by the next job's deadline. Raises JobTimeout naming an unfinished
    job once the caller's deadline has passed."""
    if watch.ready:
        return watch.take_ready()
    due = watch.due()
    if due:
        replies, redis_time = yield from job_reads.deadlines(watch.keys, due)
        due, looks, invalid = split_invalid(due, replies)
        expired = watch.drop_invalid(invalid) + watch.expired(due, looks, redis_time)
        if expired:
            return expired
    try:
        block_ms = deadline.block_ms(watch.next_expiry())
    except JobTimeout as e:
        raise JobTimeout(watch.first(), e.timeout) from None
    return (yield from read_finished(watch, block_ms, per_slot))


def results(keys: Keys, job_ids: Iterable[str], timeout: float | None, per_slot: bool) -> Steps[list[JobResult]]:
    """Every job's result, in the order of `job_ids`, collected as as_completed() yields them."""
    job_ids = check_job_ids(job_ids)
    watch, deadline = yield from watch_all(keys, job_ids, timeout)
    ended = {}
    while watch:
        for result in (yield from next_finished(watch, deadline, per_slot)):
            ended[result.id] = result
    return [ended[job_id] for job_id in job_ids]


def take_finished(watch: ResultWatch, timeout: float | None, per_slot: bool) -> Steps[list[JobResult]]:
    """Client.finished: the watched jobs that have ended, at once if any has, else as soon as one
    does; [] if none has within `timeout` seconds."""
    if not isinstance(watch, ResultWatch):  # a list of ids raised AttributeError; None read as no jobs
        raise InvalidArgument("watch", "must be a ResultWatch (as_completed() takes a list of job ids)")
    deadline = Deadline("", check_timeout(timeout))
    try:
        while watch:
            finished = yield from read_finished(watch, deadline.block_ms(), per_slot)
            if finished:
                return finished
    except JobTimeout:
        pass
    return []
