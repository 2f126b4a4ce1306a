"""How the worker speaks to Redis: its client (connect), how every pipeline of the worker
classifies what Redis answered (send_pipeline: the commands on the queue's keys, worker_queue.py
and its parts, and on each job's keys, job_commands.py, all go through it), Redis's clock as the
worker sees it, and the backoff for reaching Redis again when it cannot be reached.

On a Redis Cluster the queue's keys (its stream, dead letters, worker index) live on one shard and
each job's keys on the shard of its id; a pipeline that spans them (claims, publication, the
heartbeat) goes out as one round trip to every node it concerns at once (execution.execute).

Every exchange classifies what Redis answered in one place (`send_pipeline`): a transient failure
(connection lost, loading, out of memory, read-only during a failover) raises, and the loop backs
off and sends the same idempotent commands again; a lost consumer group (Redis restarted empty,
or flushed) raises GroupLost, and the loop creates it again and adopts the jobs it holds; any
other error stays in its command's place, charged to the job it concerns."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any

import hiredis
import redis
from redis.backoff import NoBackoff

from producer_client import connection
from producer_client.cluster import SyncRedis
from producer_client.connection import FATAL_ERRORS, Retry, reply_code
from producer_client.protocol import execution
from producer_client.protocol import worker as scripts
from producer_client.protocol.execution import AddCommands
from producer_client.protocol.replication import Replication

log = logging.getLogger(__name__)

# A draining worker makes the entries it hands over look this idle: older than any worker's
# claim_idle_ms, so the next XAUTOCLAIM anywhere takes them, even by a worker that takes nothing
# else yet (see Admission.reclaim: it asks for a tenth of this then).
HANDED_OVER_IDLE_MS = 10**10
HANDED_OVER_MIN_IDLE_MS = HANDED_OVER_IDLE_MS // 10  # an entry this idle was handed over


class ReplicasBehind(redis.RedisError):
    """A job's final result is written, but fewer replicas than `wait_replicas` confirmed it in
    time: its entry stays unacknowledged, and the worker publishes (a no-op) and waits again."""

    def __init__(self, job_id: str, confirmed: int, replication: Replication):
        super().__init__(
            f"job {job_id}: its result is written, {confirmed} of {replication.replicas} replicas confirmed it "
            f"within {replication.timeout_ms} ms; its entry is acknowledged once they do"
        )


# Failures that mean "not now" rather than "never": the loop backs off and sends the same
# (idempotent) commands again. redis-py raises most as their own classes (and strips the reply's
# first word from the message): a lost connection, loading an AOF (BusyLoadingError), memory full
# under noeviction, a replica not yet promoted by a failover, a cluster resharding or failing over,
# NOSCRIPT where the scripts were lost again after each of execution.execute's reloads (the next
# try loads them once more), and replicas that have not confirmed a result yet.
TRANSIENT_ERRORS = (
    redis.ConnectionError,
    redis.TimeoutError,
    redis.exceptions.OutOfMemoryError,
    redis.exceptions.ReadOnlyError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.NoScriptError,
    ReplicasBehind,
)
# Replies with no class of their own in redis-py, recognised by their first word: a script running
# too long, a failing RDB save, a blocking read cut short because the server turned replica (or
# back), and (for older redis-py) the classes above.
TRANSIENT_REPLIES = frozenset(
    {
        "BUSY",
        "MISCONF",
        "UNBLOCKED",
        "LOADING",
        "READONLY",
        "MASTERDOWN",
        "OOM",
        "TRYAGAIN",
        "CLUSTERDOWN",
    }
)


class GroupLost(redis.RedisError):
    """Redis no longer has the queue's consumer group (NOGROUP): it restarted without
    persistence, or was flushed, or the group was destroyed. The entries this worker held went
    with it."""


class CommandPacker:
    """Packs a command with hiredis, as redis-py's own packer does, less its scan of every
    argument for bytearrays and memoryviews, which the worker never sends: that scan cost more
    than the packing itself, and publication packs a command per publishing job per round (see
    bench/RESULTS.md). redis-py's cluster client keeps its own packer."""

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        if (" " in name) if isinstance(name, str) else (b" " in name):  # "SCRIPT LOAD": two words
            args = (*name.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError as e:
            raise redis.DataError(str(e)) from None


def connect(url: str) -> SyncRedis:
    """The worker's client, of any of the three modes. surrogateescape: a producer's invalid UTF-8
    must fail its job, not the read. One immediate retry replaces a connection Redis closed (a
    restart; on a cluster, after reading the topology again); past that the loop's own backoff
    takes over, so that the engine keeps stepping while Redis is away. Wrong credentials are not
    retried at all. A cluster client reads the topology now, so this raises while no node answers."""
    return connection.connect(
        url,
        decode_responses=True,
        encoding_errors="surrogateescape",
        retry=Retry(NoBackoff(), 1),
        command_packer=CommandPacker(),
    )


def is_transient(error: BaseException) -> bool:
    if isinstance(error, FATAL_ERRORS):
        return False
    return isinstance(error, TRANSIENT_ERRORS) or (
        isinstance(error, redis.ResponseError) and reply_code(error) in TRANSIENT_REPLIES
    )


def send_pipeline(client: SyncRedis, add_commands: AddCommands, per_command_errors: bool = False) -> list[Any]:
    """One pipeline. A transient error or a lost group raises, whichever command met it (the
    loop sends everything again later); any other error raises too, unless
    `per_command_errors`: then it stays in its command's place, for the caller to charge to
    the job it concerns."""
    replies = execution.execute(client, add_commands, scripts.WORKER_SCRIPTS, raise_on_error=False)
    errors = [r for r in replies if isinstance(r, Exception)]
    for error in errors:
        if is_transient(error):
            raise error
    for error in errors:
        if reply_code(error) == "NOGROUP":
            raise GroupLost(str(error)) from error
    if errors and not per_command_errors:
        raise errors[0]
    return replies


class RedisClock:
    """Redis's clock as this process sees it. Deadlines count from the enqueue on Redis's clock (an
    entry's id, a job's `deadline`), so the worker compares them on that clock too, whatever its
    own host's clock says; timings and heartbeats use it as well, so that they compare across
    hosts. The offset is measured with TIME at every heartbeat, to within half a round trip."""

    def __init__(self, local: Callable[[], float] = time.time):
        self.local = local
        self.offset = 0.0

    def now(self) -> float:
        return self.local() + self.offset

    def measured(self, sent_at: float, redis_time: tuple[int, int], received_at: float) -> None:
        seconds, micros = redis_time
        self.offset = int(seconds) + int(micros) / 1e6 - (sent_at + received_at) / 2


class RedisLink:
    """Whether Redis answers, and when to try again when it does not: after a failure the wait
    doubles from BACKOFF_START_S up to `max_s`, with jitter so that a fleet of workers does not
    come back in lockstep."""

    BACKOFF_START_S = 0.05

    def __init__(self, max_s: float):
        self.max_s = max_s
        self.down_since: float | None = None
        self.delay = 0.0
        self.retry_at = 0.0

    @property
    def up(self) -> bool:
        return self.down_since is None

    def ready(self) -> bool:
        """Up, or down and due for another try."""
        return self.down_since is None or time.monotonic() >= self.retry_at

    def failed(self, error: Exception, quiet: bool = False) -> None:
        """Redis failed us: wait before the next try. The first failure of an outage is logged
        unless `quiet` (the caller has said it its own way)."""
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self.delay = self.BACKOFF_START_S
            if not quiet:
                log.warning(
                    "Redis unavailable (%s: %s): retrying with backoff; running jobs go on",
                    type(error).__name__,
                    error,
                )
        else:
            self.delay = min(self.delay * 2, self.max_s)
            log.debug("Redis still unreachable: %s", error)
        self.retry_at = now + random.uniform(self.delay / 2, self.delay)

    def succeeded(self) -> float | None:
        """Marks the link up; returns for how long it was down, if it was."""
        if self.down_since is None:
            return None
        down_s, self.down_since = time.monotonic() - self.down_since, None
        return down_s

    def wait(self, at_most_s: float) -> None:
        time.sleep(max(0.0, min(at_most_s, self.retry_at - time.monotonic())))
