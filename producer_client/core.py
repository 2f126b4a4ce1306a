"""What the sync and asyncio clients share: building jobs, reading Redis replies, and the reads
that take several round trips, written as steps (producer_client.steps). No I/O here, so
`Client` and `AsyncClient` differ only in how they talk to Redis."""

from __future__ import annotations

import hashlib
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from producer_client import structured
from producer_client.connection import reply_code
from producer_client.errors import (
    BodyTooLarge,
    IdempotencyConflict,
    InvalidArgument,
    JobNotFound,
    JobTimeout,
    NotReplicated,
)
from producer_client.keys import GROUP, Keys, check_name
from producer_client.placement import prefix_key
from producer_client.protocol import producer as scripts
from producer_client.protocol.events import shown_tokens
from producer_client.protocol.script import ScriptCall
from producer_client.schema import (
    JOB_OPTIONS,
    MAX_BODY_BYTES,
    MAX_TOKENS_LIMIT,
    JobFailed,
    JobRequest,
    JobResult,
    JobStatus,
    QueueStats,
    SamplingParams,
    Timings,
    TokenDelta,
    WorkerInfo,
    invalid_argument_from,
)
from producer_client.steps import Steps, checked

DEFAULT_URL = "redis://localhost:6379/0"
DEFAULT_MAX_QUEUE_DEPTH = 10_000
EVENT_BATCH = 512  # events per XREAD: bounds one reply, not the stream
MAX_BLOCK_MS = 2000  # one blocking read, well inside redis-py's default 5 s socket timeout
MAX_LIMIT = 10_000  # items one listing returns at most: as many as a dead-letter stream holds
EVENT_ID = re.compile(r"\d{1,20}-\d{1,20}")
FINGERPRINT_CHARS = 64
FINGERPRINT = re.compile(r"[A-Za-z0-9]{1,64}")


@dataclass(frozen=True)
class NewJob:
    job_id: str
    body: str
    idempotent: bool  # the id came from the caller's request_id, so it may exist already
    timeout_ms: int  # 0: no deadline
    fingerprint: str = ""  # of the request an idempotent job answers: its request_id is bound to it
    prefix: bytes = b""  # what places it (placement.prefix_key)
    adapter: str | None = None  # the LoRA adapter it names (JobRequest.adapter)

    def create_call(self, keys: Keys) -> ScriptCall:
        return scripts.create(keys, self.job_id, self.timeout_ms, self.fingerprint)

    def created(self, reply: int) -> bool:
        """CREATE's reply: whether to enqueue the job. Raises IdempotencyConflict when its id is
        another request's."""
        if reply == -1:
            raise IdempotencyConflict(self.job_id)
        return bool(reply)

    def add_fresh_create(self, pipe, keys: Keys) -> None:
        """CREATE of a job with a fresh id: without a deadline that is one HSETNX, which costs
        Redis less than a script (nobody reads the reply of a fresh id's CREATE)."""
        if self.timeout_ms:
            self.create_call(keys).add_to(pipe)
        else:
            pipe.hsetnx(keys.job(self.job_id), "status", "queued")

    def enqueue_call(self, keys: Keys, queue: str, max_depth: int | None, stream: str | None = None) -> ScriptCall:
        """ENQUEUE of this job, into the queue's shared stream or the worker stream `stream` it was
        placed on. A worker's stream has no bound of its own: placement puts at most about twice a
        worker's slots there, and the backlog beyond in the shared stream."""
        if stream is not None:
            return scripts.enqueue(stream, 0, self.job_id, self.body)
        return scripts.enqueue(keys.queue(queue), max_depth or 0, self.job_id, self.body)


@dataclass(frozen=True)
class Replication:
    """How many replicas must confirm a write (WAIT) before it counts as made, and how long to
    wait for them. 0 replicas: no wait; Redis acknowledges a write once its master has it."""

    replicas: int = 0
    timeout_ms: int = 1000

    def __post_init__(self):
        for name, least in (("replicas", 0), ("timeout_ms", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgument(f"wait_{name}", f"must be an integer of at least {least}")

    @property
    def waits(self) -> bool:
        return self.replicas > 0


def enqueue_commands(
    keys: Keys,
    queue: str,
    max_depth: int | None,
    job: NewJob,
    create: bool,
    replication: Replication,
    stream: str | None = None,
) -> Callable:
    """The pipeline that enqueues `job`: CREATE first when `create` (a fresh id cannot collide, so
    creating and enqueueing take one round trip; CREATE sets the status only if there is none, so
    a retried pipeline never sets a started job back to queued), then ENQUEUE, then for a
    request_id's job the `enqueued` flag that tells a later submit with the same request_id that
    the entry exists (no later submit names a fresh id); with a replication to wait for, a WAIT on
    the job's node and one on the queue's (on one server they are the same: the second answers at
    once). `enqueued` reads the replies."""

    def add(pipe) -> None:
        if create:
            job.add_fresh_create(pipe, keys)
        job.enqueue_call(keys, queue, max_depth, stream).add_to(pipe)
        if job.idempotent:
            pipe.hset(keys.job(job.job_id), "enqueued", "1")
        if replication.waits:
            for key in (keys.job(job.job_id), stream or keys.queue(queue)):
                pipe.wait_replicas(key, replication.replicas, replication.timeout_ms)

    return add


def enqueued(job: NewJob, create: bool, replication: Replication, replies: list) -> list:
    """ENQUEUE's reply ({1, entry id} or {0, depth}) among those of `enqueue_commands`. Raises
    NotReplicated for an entry that fewer replicas than asked for have confirmed."""
    added = replies[1 if create else 0]
    if added[0] and replication.waits:
        confirmed = min(replies[-2:])
        if confirmed < replication.replicas:
            raise NotReplicated(job.job_id, confirmed, replication.replicas, replication.timeout_ms)
    return added


def build_job(
    prompt: Any,
    messages: Any,
    input_ids: Any,
    request_id: Any,
    timeout_s: Any,
    priority: Any,
    options: dict[str, Any],
    fingerprint: Any = None,
    stream: Any = False,
) -> NewJob:
    """Validate every argument the way the worker will, before anything touches Redis. `options`
    are SamplingParams' fields and JobRequest's other options (tools, enable_thinking..., adapter). A
    job with a request_id is bound to `fingerprint` (a digest of the request it answers; by
    default of what it generates from): a later submit of the same id with another raises
    IdempotencyConflict."""
    sampling = {k: v for k, v in options.items() if k not in JOB_OPTIONS}
    chat = {k: v for k, v in options.items() if k in JOB_OPTIONS}
    try:
        params = SamplingParams.model_validate(sampling, strict=True)
        request = JobRequest.model_validate(
            {
                "prompt": prompt,
                "messages": messages,
                "input_ids": input_ids,
                "params": params,
                "priority": priority,
                "timeout_s": timeout_s,
                "stream": stream,
                **chat,
            },
            strict=True,
        )
    except ValidationError as e:
        raise invalid_argument_from(e, strip="params.") from None
    request.check(MAX_TOKENS_LIMIT)
    check_grammars(request)
    body = request.to_json()
    size = len(body.encode())
    if size > MAX_BODY_BYTES:
        raise BodyTooLarge("body", f"{size} bytes exceeds the limit of {MAX_BODY_BYTES}")
    timeout_ms = 0 if request.timeout_s is None else max(1, round(request.timeout_s * 1000))
    if request_id is None:
        # 128 random bits, as a uuid4's hex without building the UUID: submit_many makes many.
        return NewJob(
            os.urandom(16).hex(),
            body,
            idempotent=False,
            timeout_ms=timeout_ms,
            prefix=prefix_key(request),
            adapter=request.adapter,
        )
    if fingerprint is None:
        fingerprint = generation_fingerprint(request)
    elif not isinstance(fingerprint, str) or not FINGERPRINT.fullmatch(fingerprint):
        raise InvalidArgument("request_fingerprint", f"must be 1-{FINGERPRINT_CHARS} letters and digits")
    return NewJob(
        check_name("request_id", request_id),
        body,
        idempotent=True,
        timeout_ms=timeout_ms,
        fingerprint=fingerprint,
        prefix=prefix_key(request),
        adapter=request.adapter,
    )


def generation_fingerprint(request: JobRequest) -> str:
    """A digest of what a job generates from: its prompt, sampling parameters and chat options.
    Not its deadline or priority: a retry may count its deadline from its own start; nor whether
    it is streamed: a retry may read the same job whole."""
    generation = request.model_dump_json(exclude={"timeout_s", "priority", "stream"})
    return hashlib.sha256(generation.encode()).hexdigest()


def check_grammars(request: JobRequest) -> None:
    """Refuses, before anything is enqueued, what the worker would hold the output to and could not
    compile: the response_format, and the tools' parameters where a call is enforced (a forced
    tool_choice, or tools beside a response_format)."""
    fmt = request.params.response_format
    if fmt is not None:
        structured.check_format(fmt)
    forced = request.tool_choice not in (None, "auto", "none")
    if forced or fmt is not None:
        for i, tool in enumerate(request.tools or []):
            if tool.function.parameters is not None and tool in request.offered_tools():
                structured.check_schema(tool.function.parameters, f"tools.{i}.function.parameters")


def check_job_id(job_id: Any) -> str:
    return check_name("job_id", job_id)


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


def read_cut_short(error: Exception) -> bool:
    """A blocking read that Redis ended with UNBLOCKED: the server turned replica, or back, during
    a failover. Nothing was read; reading again is right."""
    return reply_code(error) == "UNBLOCKED"


def cancel_call(keys: Keys, job_id: str) -> ScriptCall:
    """CANCEL, with the result the job gets if no worker started it yet."""
    result = JobResult(id=job_id, status="cancelled", finish_reason="abort", timings=Timings(finished_at=time.time()))
    return scripts.cancel(keys, job_id, result.model_dump_json())


def finished(job_id: str, result_json: str) -> JobResult:
    """The job's final result; a failed job raises JobFailed carrying it."""
    result = JobResult.model_validate_json(result_json)
    if result.status == "failed":
        error = result.error
        raise JobFailed(error.code if error else "error", error.message if error else "failed", result)
    return result


def token_delta(event_id: str, data: str, split: Callable[[str], dict[str, Any]] | None = None) -> TokenDelta:
    """A `tokens` event as a TokenDelta; `split` turns its text into a chat's fields (JobStream)."""
    payload = shown_tokens(data)
    text = {"text": payload["text"]} if split is None else split(payload["text"])
    return TokenDelta(event_id=event_id, token_ids=payload["ids"], logprobs=payload["logprobs"], **text)


def job_status(job_id: str, fields: dict[str, str], redis_time: tuple[int, int]) -> JobStatus:
    """From HGETALL of the job's hash and TIME. A queued job past its deadline is `expired`
    already: no worker will start it (the first to read its entry records that)."""
    if not fields:
        raise JobNotFound(job_id)
    result = fields.get("result")
    status = fields["status"]
    deadline_ms = fields.get("deadline")
    if status == "queued" and deadline_ms is not None and epoch_ms(redis_time) > int(deadline_ms):
        status = "expired"
    return JobStatus(
        id=job_id,
        status=status,
        tokens=int(fields.get("tokens", 0)),
        worker=fields.get("worker"),
        cancel_requested=fields.get("cancel") == "1",
        result=None if result is None else JobResult.model_validate_json(result),
    )


def epoch_ms(redis_time: tuple[int, int]) -> int:
    """TIME's reply (seconds, microseconds) in milliseconds."""
    seconds, micros = redis_time
    return int(seconds) * 1000 + int(micros) // 1000


def entry_time(entry_id: str) -> float:
    """When Redis added a stream entry: its id's milliseconds, in epoch seconds (Redis's clock)."""
    return entry_ms(entry_id) / 1000


def entry_ms(entry_id: str) -> int:
    return int(entry_id.split("-", 1)[0])


def entry_age_s(entry_id: str, now_ms: int) -> float:
    """How long ago Redis added the entry, from its clock's milliseconds: subtracted as integers,
    so an age of exactly 200 ms reads 0.2, not the 0.19999981 two epoch floats would give."""
    return (now_ms - entry_ms(entry_id)) / 1000


def queue_stats(queue: str, depth: int, groups: list[dict], names: list[str], alive: list[int]) -> QueueStats:
    """From XLEN, XINFO GROUPS (empty when the queue is empty), the worker index and EXISTS
    on each worker's heartbeat key: the heartbeat's TTL runs on the Redis clock."""
    group = next((g for g in groups if g["name"] == GROUP), None)
    pending = group["pending"] if group else 0
    lag = group.get("lag") if group else None
    # Acked entries are deleted, so depth = waiting + pending whenever Redis cannot tell the lag.
    waiting = lag if lag is not None else depth - pending
    return QueueStats(
        queue=queue,
        depth=depth,
        pending=pending,
        waiting=waiting,
        workers=[n for n, a in zip(names, alive) if a],
    )


def live_workers(heartbeats: list[dict[str, str]]) -> list[WorkerInfo]:
    """The workers whose heartbeat hash still exists (HGETALL of an expired one is empty)."""
    return [WorkerInfo.model_validate(h) for h in heartbeats if h]


# -- reads of several round trips, as steps ---------------------------------------------------------


def read_status(keys: Keys, job_id: str) -> Steps[JobStatus]:
    fields, redis_time = checked((yield lambda pipe: (pipe.hgetall(keys.job(job_id)), pipe.time())))
    return job_status(job_id, fields, redis_time)


def read_queue_stats(keys: Keys, queue: str) -> Steps[QueueStats]:
    stream = keys.queue(queue)
    depth, names = checked((yield lambda pipe: (pipe.xlen(stream), pipe.zrange(keys.workers(queue), 0, -1))))

    def add(pipe) -> None:
        # XINFO GROUPS fails on a stream that does not exist; an empty one has nothing to say.
        if depth:
            pipe.xinfo_groups(stream)
        for name in names:
            pipe.exists(keys.worker(name))

    replies = checked((yield add))
    groups = replies.pop(0) if depth else []
    return queue_stats(queue, depth, groups, names, replies)


def read_live_workers(keys: Keys) -> Steps[list[WorkerInfo]]:
    """Every live worker of every queue, from the queue index, each queue's worker index and the
    heartbeats (an expired heartbeat is a dead worker): which models are served where. On a
    cluster the indexes and heartbeats lie on many shards: each step is one round trip to all of
    them at once."""
    (queues,) = checked((yield lambda pipe: pipe.zrange(keys.queues(), 0, -1)))

    def add_indexes(pipe) -> None:
        for queue in queues:
            pipe.zrange(keys.workers(queue), 0, -1)

    names = [name for index in checked((yield add_indexes)) for name in index]

    def add_heartbeats(pipe) -> None:
        for name in names:
            pipe.hgetall(keys.worker(name))

    return live_workers(checked((yield add_heartbeats)))
