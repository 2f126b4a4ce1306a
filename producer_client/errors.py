"""Typed errors. Each carries a stable `code`; failed job results use the same codes. JobFailed,
which carries the failed job's result, is defined beside JobResult in schema.py."""

from __future__ import annotations

import redis
import redis.exceptions

from producer_client.rate_limits import RateLimits


class MiliError(Exception):
    code = "error"
    # From submit_many: the ids of the specs enqueued when it stopped (bulk.WentIn.ids_of), whatever
    # stopped it; None from any other call.
    job_ids: list[str] | None = None

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidArgument(MiliError):
    """A request argument is out of range or malformed; `field` names it."""

    code = "invalid_argument"

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message

    def named(self, field: str) -> InvalidArgument:
        """The same error, of a field its caller names otherwise."""
        return type(self)(field, self.detail)


class OutOfRange(InvalidArgument):
    """A number past a bound of its field's: `below` its minimum, else above its maximum; a
    `decimal` field's, else an integer's (the gateway's OpenAI codes, integer_below_min_value to
    decimal_above_max_value, as for the fields it checks itself)."""

    def __init__(self, field: str, message: str, below: bool, decimal: bool = False):
        super().__init__(field, message)
        self.below = below
        self.decimal = decimal

    def named(self, field: str) -> OutOfRange:
        return OutOfRange(field, self.detail, self.below, self.decimal)


class TooLong(InvalidArgument):
    """A string longer than its field allows (the gateway's string_above_max_length, OpenAI's code
    for it)."""


class BodyTooLarge(InvalidArgument):
    """The job's JSON body exceeds the size limit."""

    code = "body_too_large"


class InvalidBody(MiliError):
    """A queue entry whose body is not a JSON object, or that lacks a required field."""

    code = "invalid_body"


class UnsupportedVersion(MiliError):
    """A queue entry written for a protocol version this worker does not speak."""

    code = "unsupported_version"


class IdempotencyConflict(MiliError):
    """A request_id (or a gateway's Idempotency-Key) was first used with another request: its job
    answers that request, not this one."""

    code = "idempotency_conflict"

    def __init__(self, request_id: str):
        super().__init__(
            f"request_id {request_id!r} was first used with another request; use a new id for a new request"
        )
        self.request_id = request_id


class QueueFull(MiliError):
    """The queue holds `max_depth` unacknowledged jobs already; retry later."""

    code = "queue_full"

    def __init__(self, queue: str, depth: int, max_depth: int):
        super().__init__(f"queue {queue!r} holds {depth} jobs, the maximum is {max_depth}")
        self.queue = queue
        self.depth = depth
        self.max_depth = max_depth


class InvalidQueueStream(MiliError):
    """A stream of the queue's jobs holds another type than a stream (a producer may write one): it
    held jobs, which went with the DEL that changed its type, so no script can make it anew. Nothing
    is enqueued there until an operator deletes it; the queue's other streams, its other lanes and
    tenants, are served. Asking again will not mend it (the gateway's 500, not retried)."""

    code = "invalid_queue_stream"

    def __init__(self, queue: str, lane: str, tenant: str):
        super().__init__(
            f"queue {queue!r}: the stream of lane {lane!r} of tenant {tenant!r} holds another type than a stream, "
            "which no MILI program writes: nothing is enqueued there until an operator deletes it"
        )
        self.queue = queue
        self.lane = lane
        self.tenant = tenant


class InvalidQuotaKey(MiliError):
    """A key of the tenants' quotas (a tenant's settings hash, the index of the tenants that have
    settings) holds another type than MILI writes there (`found`, as TYPE names it): `mili quota
    set` writes nothing until an operator deletes it. Reads take such a key for no settings."""

    code = "invalid_quota_key"

    def __init__(self, key: str, found: str, kind: str):
        super().__init__(
            f"{key} holds a {TYPE_NAMES.get(found, found)}, not the {TYPE_NAMES.get(kind, kind)} MILI writes there: "
            "mili quota set writes nothing until an operator deletes it"
        )
        self.key = key
        self.found = found


TYPE_NAMES = {"zset": "sorted set"}  # Redis's TYPE names other than the documentation's


class WaitingQuotaExceeded(QueueFull):
    """The tenant has `max_waiting` jobs nobody has read yet, across the queue's lanes: its quota
    (`mili quota set TENANT --max-waiting N`). Other tenants' submits are not refused for it. From
    submit_many, `job_ids` are those of the specs enqueued, a prefix of them, as BulkQueueFull's."""

    def __init__(self, queue: str, tenant: str, waiting: int, max_waiting: int, job_ids: list[str] | None = None):
        MiliError.__init__(
            self,
            f"tenant {tenant!r} has {waiting} jobs waiting in queue {queue!r}, its max_waiting quota is {max_waiting}",
        )
        self.queue = queue
        self.tenant = tenant
        self.depth = waiting
        self.max_depth = max_waiting
        self.job_ids = job_ids


class RateLimited(MiliError):
    """The tenant is over its requests-per-minute or tokens-per-minute limit on the queue
    (`which`: "requests" or "tokens"); nothing was enqueued. `reset_s`: when the request would
    be admitted, in seconds from now (the gateway's Retry-After). `limits`: the tenant's limits as
    they stand (producer_client.rate_limits.RateLimits). From submit_many, `job_ids` are those of the
    specs enqueued, a prefix of them, as BulkQueueFull's."""

    code = "rate_limit_exceeded"

    def __init__(
        self,
        queue: str,
        tenant: str,
        which: str,
        limit: int,
        reset_s: float,
        limits: RateLimits | None = None,
        job_ids: list[str] | None = None,
    ):
        super().__init__(
            f"tenant {tenant!r} is over its limit of {limit} {which} per minute on queue {queue!r}: "
            f"retry in {reset_s:.3f}s"
        )
        self.queue = queue
        self.tenant = tenant
        self.which = which
        self.limit = limit
        self.reset_s = reset_s
        self.limits = limits
        self.job_ids = job_ids


class BulkQueueFull(QueueFull):
    """submit_many met a full queue part-way. `job_ids` are the jobs of the first len(job_ids)
    specs, in order, all in the queue (or found there, for a request_id seen before); no later
    spec was enqueued, so submitting those again carries on where this stopped."""

    def __init__(self, queue: str, depth: int, max_depth: int, job_ids: list[str]):
        super().__init__(queue, depth, max_depth)
        self.job_ids = job_ids


class ShardCountMismatch(MiliError):
    """The queue is spread over `stored` shards (the count its first worker or producer wrote), and
    this client or worker was started with `asked`: it refuses to enqueue or read anything, as its
    jobs would land where the queue's workers read nothing, or it would leave shards unread."""

    code = "shard_count_mismatch"

    def __init__(self, queue: str, asked: int, stored: int):
        super().__init__(
            f"queue {queue!r} is spread over {stored} shards, not {asked}: start with --queue-shards {stored} "
            "(changing a queue's count: docs/architecture.md, 'A queue over several shards')"
        )
        self.queue = queue
        self.asked = asked
        self.stored = stored


class InvalidShardCount(MiliError):
    """The queue's stored shard count (the field `shards` of its scheduler hash, which producers
    may write) is not a count MILI writes: nothing is enqueued or read until an operator fixes it."""

    code = "invalid_shard_count"

    def __init__(self, queue: str, stored: object, most: int):
        super().__init__(
            f"queue {queue!r} has {stored!r} as its shard count, not an integer from 1 to {most}: set the "
            "field `shards` of its scheduler hash right, or delete it on an empty queue "
            "(docs/architecture.md, 'A queue over several shards')"
        )
        self.queue = queue
        self.stored = stored


class UnknownAdapter(MiliError):
    """A job names a LoRA adapter that no worker of its queue serves (the producer knows it from
    the heartbeats), or that the worker it reached does not serve. OpenAI's code for an unknown
    model, as the gateway answers it."""

    code = "model_not_found"

    def __init__(self, adapter: str, where: str):
        super().__init__(f"no LoRA adapter named {adapter!r} is served {where}")
        self.adapter = adapter


class JobNotFound(MiliError):
    """No such job: never submitted, or its result has expired."""

    code = "not_found"

    def __init__(self, job_id: str):
        super().__init__(f"job {job_id!r} not found (never submitted, or its result expired)")
        self.job_id = job_id


class InvalidJob(MiliError):
    """A job's keys hold what no worker writes there (a producer may write them): its status
    cannot be told. The code is the one a worker fails such a job with (`invalid_job`)."""

    code = "invalid_job"

    def __init__(self, job_id: str, what: str):
        super().__init__(f"job {job_id!r}: {what}, which no worker writes: submit it anew under a fresh id")
        self.job_id = job_id


class JobTimeout(MiliError):
    """Waiting for a job timed out. The job itself may still be queued or running."""

    code = "timeout"

    def __init__(self, job_id: str, timeout: float):
        super().__init__(f"job {job_id!r} did not finish within {timeout:g}s")
        self.job_id = job_id
        self.timeout = timeout


class NotReplicated(MiliError):
    """A submit asked for `replicas` replicas (WAIT) and fewer confirmed its job in time. The job
    is enqueued on the master and will run, unless a failover loses it first."""

    code = "not_replicated"

    def __init__(self, job_id: str, confirmed: int, replicas: int, timeout_ms: int):
        super().__init__(
            f"job {job_id!r} is enqueued, but {confirmed} of the {replicas} replicas asked for confirmed it within "
            f"{timeout_ms} ms: a failover now could lose it (submitting it again with its request_id is safe)"
        )
        self.job_id = job_id
        self.confirmed = confirmed
        self.replicas = replicas


class PermissionDenied(MiliError, redis.exceptions.NoPermissionError):
    """Redis's ACL refused this client's user a command or a key (NOPERM): `command` names the
    command (a script's EVALSHA names the script's first key, the key class its rights must
    cover), `detail` Redis's reason (the command, the key or the channel it may not touch). No
    retry mends it (docs/security.md: each role's rights). A redis-py NoPermissionError too, so
    that code written against redis-py's class still catches it."""

    code = "redis_refused"

    def __init__(self, command: str, detail: str):
        super().__init__(
            f"Redis refused {command} to this client's user (NOPERM {detail}): grant the user that right "
            "(docs/security.md)"
        )
        self.command = command
        self.detail = detail
        self.status_code = "NOPERM"  # where redis-py keeps an error reply's first word (connection.reply_code)


class WritesRefused(MiliError):
    """Redis refused a command's writes for now: memory full under maxmemory with `noeviction`
    (OOM), or a replica's copy (READONLY: a master demoted in a failover). Nothing of the command
    was written; as with RedisUnavailable, sending it again helps once Redis takes writes again.
    `command` names it as PermissionDenied's does, `detail` is Redis's reason. Each kind is also
    the redis-py class it stands for, so that code written against redis-py's class still catches
    it; from submit_many, `job_ids` names the jobs in the queue."""

    code = "redis_unavailable"
    reply = ""  # the first word of Redis's reply, which redis-py strips from the message
    status_code: str | None  # as redis-py's RedisError, the other base of each kind

    def __init__(self, command: str, detail: str):
        super().__init__(f"Redis refused {command} for now ({self.reply} {detail}): try again once it takes writes")
        self.command = command
        self.detail = detail
        self.status_code = self.reply  # where redis-py keeps an error reply's first word (connection.reply_code)


class RedisOutOfMemory(WritesRefused, redis.exceptions.OutOfMemoryError):
    reply = "OOM"


class RedisReadOnly(WritesRefused, redis.exceptions.ReadOnlyError):
    reply = "READONLY"


class CredentialsRefused(MiliError, redis.AuthenticationError):
    """Redis refused the URL's user name and password (or wants one and got none): no retry mends
    it. `where` is the server as a message may show it, without the URL's credentials. A redis-py
    AuthenticationError (a ConnectionError) too."""

    code = "redis_refused"

    def __init__(self, where: str, detail: str):
        super().__init__(
            f"Redis at {where} refused this client's credentials: {detail} (fix the URL's user or password)"
        )
        self.where = where
        self.detail = detail  # Redis's reason


class RedisRefused(MiliError, redis.ResponseError):
    """Redis refused a program at its start with an error no retry mends: `mili`'s first check met
    one that is neither an ACL's nor a password's (a `redis+cluster://` URL of a server with cluster
    mode off, a database the server does not have, a URL option it refuses), or a worker any fatal
    one (connection.is_fatal). `where` as CredentialsRefused's; `detail` Redis's reason; `whom`
    the program. A redis-py ResponseError too."""

    code = "redis_refused"

    def __init__(self, where: str, detail: str, whom: str = "this client"):
        super().__init__(f"Redis at {where} refused {whom}: {detail}")
        self.where = where
        self.detail = detail


class RedisUnavailable(MiliError, redis.ConnectionError):
    """Redis could not be reached, or dropped the connection, for all of the call's tries (about 6 s
    on one server, 36 s under Sentinel or on a cluster): refused, reset, a name that does not
    resolve. `where` is the server as a message may show it, without the URL's credentials. A
    redis-py ConnectionError too; the call may be sent again once Redis is back. `job_id`: the job
    a call on one job was about (submit, result, cancel...; None: no one job), which the message
    names too: a caller handling many jobs learns which call failed; a submit's job may or may not
    be in (submitting it again with its request_id is safe)."""

    code = "redis_unavailable"

    def __init__(self, where: str, detail: str, job_id: str | None = None):
        about = "" if job_id is None else f" (a call on job {job_id!r})"
        super().__init__(f"Redis at {where} is unavailable{about}: {detail}")
        self.where = where
        self.detail = detail  # redis-py's error, as its type and text
        self.job_id = job_id

    def of_job(self, job_id: str) -> RedisUnavailable:
        """The same error, of a call on the job `job_id`; of its own kind (RedisTimedOut stays one)."""
        return type(self)(self.where, self.detail, job_id)


class RedisTimedOut(RedisUnavailable, redis.TimeoutError):
    """RedisUnavailable where Redis did not answer within the socket's timeout; a redis-py
    TimeoutError too."""
