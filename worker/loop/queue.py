"""The worker's side of protocol v1 on the queue's keys (its streams, consumer group, dead
letters, worker index): every command the queue loop sends there, batched so that one loop
iteration costs a few round trips; how every pipeline of the worker classifies what Redis
answered (send_pipeline: the commands on each job's keys, worker/loop/job_commands.py, go through
it too); Redis's clock as the worker sees it; and the backoff for reaching Redis again when it
cannot be reached.

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
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis
from redis.backoff import NoBackoff

from producer_client import connection
from producer_client.cluster import is_cluster
from producer_client.connection import FATAL_ERRORS, Retry, reply_code
from producer_client.keys import GROUP, Keys
from producer_client.protocol import execution, producer
from producer_client.protocol import worker as scripts
from producer_client.protocol.execution import AddCommands, Pipe
from producer_client.protocol.replication import Replication
from worker.loop.intake import Delivery
from worker.loop.jobs import Job
from worker.loop.outbox import DeadLetter
from worker.loop.streams import QueueStreams, entry_ref

log = logging.getLogger(__name__)

# Names of workers whose heartbeat is this stale are dropped from the queue's worker index (and
# queues no worker has served for this long from the queue index).
WORKER_INDEX_RETENTION_S = 3600
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


def connect(url: str) -> redis.Redis:
    """The worker's client, of any of the three modes. surrogateescape: a producer's invalid UTF-8
    must fail its job, not the read. One immediate retry replaces a connection Redis closed (a
    restart; on a cluster, after reading the topology again); past that the loop's own backoff
    takes over, so that the engine keeps stepping while Redis is away. Wrong credentials are not
    retried at all. A cluster client reads the topology now, so this raises while no node answers."""
    client: redis.Redis = connection.connect(
        url,
        decode_responses=True,
        encoding_errors="surrogateescape",
        retry=Retry(NoBackoff(), 1),
        command_packer=CommandPacker(),
    )
    return client


def is_transient(error: BaseException) -> bool:
    if isinstance(error, FATAL_ERRORS):
        return False
    return isinstance(error, TRANSIENT_ERRORS) or (
        isinstance(error, redis.ResponseError) and reply_code(error) in TRANSIENT_REPLIES
    )


def send_pipeline(client: redis.Redis, add_commands: AddCommands, per_command_errors: bool = False) -> list[Any]:
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


class WorkerQueue:
    """`placed`: this worker reads a stream of its own before the shared one (cache-aware
    placement: docs/architecture.md). While idle it blocks on both at once on one server; on a
    cluster, where they lie on different nodes, it blocks on the shared one for at most `poll_ms`
    at a time, so that a job placed on it waits no longer than that."""

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        queue: str,
        worker: str,
        clock: RedisClock | None = None,
        placed: bool = False,
        poll_ms: int = 50,
    ):
        self.redis = client
        self.keys = keys
        self.queue = queue
        self.worker = worker
        self.clock = clock or RedisClock()
        self.stream = keys.queue(queue)
        self.streams = QueueStreams(keys, queue)
        self.own = keys.own_queue(queue, worker) if placed else None
        self.poll_ms = poll_ms
        self.reclaim_cursor = "0-0"
        self.peers: list[str] = []  # every worker of the queue's index, as of the last heartbeat

    def _send(self, add_commands: AddCommands, per_command_errors: bool = False) -> list[Any]:
        return send_pipeline(self.redis, add_commands, per_command_errors)

    def ensure_group(self) -> None:
        # Looked up first: XGROUP CREATE is refused while Redis is out of memory, even for a group
        # that exists. From id 0, not $: jobs submitted before the first worker started run too.
        for stream in self._read_streams():
            if self._group_exists(stream):
                continue
            try:
                self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def group_exists(self) -> bool:
        return all(self._group_exists(stream) for stream in self._read_streams())

    def _read_streams(self) -> list[str]:
        return [self.stream] if self.own is None else [self.own, self.stream]

    def _group_exists(self, stream: str) -> bool:
        try:
            groups = self.redis.xinfo_groups(stream)
        except redis.ResponseError as e:
            if is_transient(e):
                raise
            return False  # no such key: the stream is gone, and its group with it
        return any(g["name"] == GROUP for g in groups)

    def read(
        self,
        count: int,
        block_ms: int | None,
        acks: list[str],
        dead_letters: Sequence[DeadLetter] = (),
    ) -> list[Delivery]:
        """Acknowledge and delete `acks`, move `dead_letters`, then read up to `count` new entries:
        from this worker's own stream first, then from the shared one. The acks go first in the
        same pipeline, so the pending list never holds a finished job while new ones arrive:
        pending entries <= the engine's slots."""
        if not (acks or dead_letters or count > 0):
            return []
        if self.own is not None and block_ms is not None and count >= 2 and not is_cluster(self.redis):
            return self._read_both(count, block_ms, acks, dead_letters)
        first = self.own or self.stream
        replies = self._send(lambda pipe: self._settle(pipe, acks, dead_letters, first, count, block_ms))
        taken = self._entries(first, replies[-1] if count > 0 else None)
        rest = count - len(taken)
        if self.own is not None and rest > 0:
            block = None if taken or block_ms is None else min(block_ms, self.poll_ms)
            reply = self._send(lambda pipe: self._read_into(pipe, self.stream, rest, block))[0]
            taken += self._entries(self.stream, reply)
        return taken

    def _read_both(
        self, count: int, block_ms: int, acks: list[str], dead_letters: Sequence[DeadLetter]
    ) -> list[Delivery]:
        """An idle worker on one server: one XREADGROUP blocks on its own stream and the shared one
        at once (they are on the same node), so that a job on either wakes it at once; half the
        room from each, so that it never takes more than it can start (COUNT is per stream)."""
        streams = {self.own: ">", self.stream: ">"}

        def add(pipe: Pipe) -> None:
            self._settle(pipe, acks, dead_letters, self.stream, 0, None)
            pipe.xreadgroup(GROUP, self.worker, streams, count=count // 2, block=block_ms)

        reply = self._send(add)[-1] or []
        return [d for key, entries in reply for d in self._entries(key, [(key, entries)])]

    def _settle(
        self,
        pipe: Pipe,
        acks: list[str],
        dead_letters: Sequence[DeadLetter],
        stream: str,
        count: int,
        block_ms: int | None,
    ) -> None:
        self.streams.add_acks(pipe, acks)
        now = self.clock.now()
        for letter in dead_letters:
            self.streams.add_dead_letter(pipe, letter.entry_id, letter.letter(self.worker, now))
        if count > 0:
            self._read_into(pipe, stream, count, None if stream != self.stream else block_ms)

    def _read_into(self, pipe: Pipe, stream: str, count: int, block_ms: int | None) -> None:
        pipe.xreadgroup(GROUP, self.worker, {stream: ">"}, count=count, block=block_ms)

    def _entries(self, stream: str, reply: list[Any] | None) -> list[Delivery]:
        if not reply:
            return []
        owner = None if stream == self.stream else self.worker
        return [Delivery(entry_ref(entry_id, owner), fields) for entry_id, fields in reply[0][1]]

    def reclaim(self, count: int, min_idle_ms: int) -> list[Delivery]:
        """XAUTOCLAIM up to `count` entries idle longer than `min_idle_ms`: jobs of workers that
        died or stalled. The scan resumes where the last one stopped, so every pending entry is
        reached in turn."""
        call = scripts.reclaim(
            self.stream, self.worker, min_idle_ms, self.reclaim_cursor, count, HANDED_OVER_MIN_IDLE_MS
        )
        cursor, claimed = self._send(call.add_to)[0]
        self.reclaim_cursor = cursor
        return [Delivery(entry_id, _fields(flat), n, bool(handed)) for entry_id, flat, n, handed in claimed]

    def take_over(
        self, owner: str, count: int, min_idle_ms: int, steal_before_ms: int
    ) -> tuple[list[Delivery], list[Delivery]]:
        """TAKE_OVER on `owner`'s own stream: (up to `count` entries reclaimed after `min_idle_ms`,
        then entries stolen that nobody read since before `steal_before_ms`; 0: none). An error in
        its place raises as any other, but for a key of another type, which TAKE_OVER passes over."""
        call = scripts.take_over(
            self.streams.of(owner), self.worker, min_idle_ms, steal_before_ms, count, HANDED_OVER_MIN_IDLE_MS
        )
        reclaimed, stolen = self._send(call.add_to)[0]
        return (
            [Delivery(entry_ref(i, owner), _fields(flat), n, bool(handed)) for i, flat, n, handed in reclaimed],
            [Delivery(entry_ref(i, owner), _fields(flat)) for i, flat in stolen],
        )

    def takeable(self, owners: list[str], min_idle_ms: int, steal_before_ms: dict[str, int]) -> list[bool | Exception]:
        """TAKEABLE on each owner's stream, in one pipeline: whether TAKE_OVER would take anything
        there, or the error that stream gave (a producer may write it) in its place."""

        def add(pipe: Pipe) -> None:
            for owner in owners:
                scripts.takeable(self.streams.of(owner), min_idle_ms, steal_before_ms[owner]).add_to(pipe)

        return [r if isinstance(r, Exception) else r == 1 for r in self._send(add, per_command_errors=True)]

    def requeue(self, job: Job) -> bool:
        """Give a detached job back to the queue (REQUEUE, then a fresh entry)."""
        if not self._send(scripts.requeue(self.keys, job.id, job.run).add_to)[0]:
            return False
        self._send(producer.enqueue(self.stream, 0, job.id, job.request.to_json()).add_to)
        return True

    def heartbeat(self, fields: dict[str, str | int | float], ttl_s: float, held: list[str]) -> tuple[int, list[str]]:
        """Refresh this worker's heartbeat hash, its place in the worker and queue indexes, the
        idle time of the entries it holds (REFRESH), and the Redis clock. Returns the queue depth
        and the held entries it has lost."""
        key = self.keys.worker(self.worker)
        index = self.keys.workers(self.queue)
        now = self.clock.now()

        def add(pipe: Pipe) -> None:
            pipe.time()
            pipe.hset(key, mapping={**fields, "updated_at": now})
            pipe.pexpire(key, int(ttl_s * 1000))
            pipe.zadd(index, {self.worker: now})
            pipe.zremrangebyscore(index, "-inf", now - WORKER_INDEX_RETENTION_S)
            pipe.zadd(self.keys.queues(), {self.queue: now})
            pipe.zremrangebyscore(self.keys.queues(), "-inf", now - WORKER_INDEX_RETENTION_S)
            pipe.xlen(self.stream)
            pipe.zrange(index, 0, -1)
            self.streams.add_refreshes(pipe, self.worker, by_stream)

        by_stream = self.streams.by_stream(held)
        owners = self.streams.owners(held)
        sent_at = self.clock.local()
        replies = self._send(add)
        self.clock.measured(sent_at, replies[0], self.clock.local())
        self.peers = replies[8]
        lost = [entry_ref(i, owners[stream]) for stream, reply in zip(by_stream, replies[9:]) for i in reply]
        return replies[7], lost

    def release(self, entry_ids: list[str]) -> int:
        """Hand unfinished entries over to other workers (RELEASE); returns how many were ours."""
        by_stream = self.streams.by_stream(entry_ids)
        add = self.streams.add_releases(self.worker, HANDED_OVER_IDLE_MS, by_stream)
        return sum(self._send(add)) if by_stream else 0

    def leave(self) -> None:
        """Remove this worker's heartbeat: it no longer counts as live. With placement its name
        stays in the queue's worker index (until WORKER_INDEX_RETENTION_S prunes it), because that
        index is where the others find its stream: a producer whose view was read before the drain
        may still place jobs there, and they are stolen."""

        def add(pipe: Pipe) -> None:
            pipe.delete(self.keys.worker(self.worker))
            if self.own is None:
                pipe.zrem(self.keys.workers(self.queue), self.worker)

        self._send(add)


def _fields(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2]))


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
