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
from producer_client.cluster import SyncRedis, is_cluster
from producer_client.connection import FATAL_ERRORS, Retry, reply_code
from producer_client.keys import LANES, Keys
from producer_client.protocol import consumer, execution, producer, registry
from producer_client.protocol import worker as scripts
from producer_client.protocol.backlog import shard_parts, shard_ref
from producer_client.protocol.execution import AddCommands, Pipe
from producer_client.protocol.lanes import DEFAULT_COST
from producer_client.protocol.replication import Replication
from producer_client.protocol.script import ScriptCall, add_all
from producer_client.protocol.shards import shard_names, shard_of
from worker.loop.fairness import Owed
from worker.loop.intake import Delivery
from worker.loop.jobs import Job
from worker.loop.outbox import DeadLetter
from worker.loop.streams import DEFAULT_ROUTE, QueueStreams, Route, entry_ref, lane_ref

log = logging.getLogger(__name__)

# A draining worker makes the entries it hands over look this idle: older than any worker's
# claim_idle_ms, so the next XAUTOCLAIM anywhere takes them, even by a worker that takes nothing
# else yet (see Admission.reclaim: it asks for a tenth of this then).
HANDED_OVER_IDLE_MS = 10**10
HANDED_OVER_MIN_IDLE_MS = HANDED_OVER_IDLE_MS // 10  # an entry this idle was handed over
REFUSED = "!"  # READ's reply for a lane stream that refused (a key of another type)
OWN = "own"  # READ's reply for the entries of the worker's own stream, where READ reads it
# The most flex entries one READ takes, however much room the worker has: the entries read are
# parsed, claimed and started in the iteration that read them, and a default or priority job that
# arrives meanwhile is read at the next one. Behind a flood of short flex jobs, which start together
# and end together, a worker with 256 free slots read 256 flex entries at once, and a default job's
# wait grew with that iteration (bench/RESULTS.md, "Sharing rules"). Flex alone, as flex is the lane
# that waits for the others: a read of the default or priority lane still takes all the room, so a
# bulk load of default jobs keeps its throughput.
FLEX_READ_BATCH = 16


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


class Settle:
    """What a read sends before it reads, once: acknowledgements (and deletes) of settled entries,
    dead letters, and the doorbell's entries this worker was woken by."""

    def __init__(self, acks: list[str], dead_letters: Sequence[DeadLetter], bells: list[str]):
        self.acks, self.dead_letters, self.bells = list(acks), list(dead_letters), list(bells)
        self.sent = not (self.acks or self.dead_letters or self.bells)

    def add_to(self, pipe: Pipe, queue: WorkerQueue) -> None:
        if self.sent:
            return
        queue.streams.add_acks(pipe, self.acks)
        for shard, bells in queue.bells_by_shard(self.bells).items():
            consumer.add_bells_answered(pipe, queue.keys, queue.shard_names[shard], bells)
        now = queue.clock.now()
        for letter in self.dead_letters:
            queue.streams.add_dead_letter(pipe, letter.entry_id, letter.letter(queue.worker, now))
        self.sent = True

    def before(self, queue: WorkerQueue, add: AddCommands) -> AddCommands:
        """`add`, with this settlement first in the same pipeline (unless it went already)."""

        def both(pipe: Pipe) -> None:
            self.add_to(pipe, queue)
            add(pipe)

        return both


def lane_deliveries(reply: list[Any], shard: int = 0, owner: str | None = None) -> list[Delivery]:
    """READ's reply (of shard `shard`): each entry named by its lane's reference and charged its cost;
    those of `owner`'s own stream, which READ read first where it was given it, by their stream's."""
    taken: list[Delivery] = []
    for lane, tenant, entries in reply:
        if lane == REFUSED:
            log.error("the lane stream %s refused a read (%s): its jobs wait until it is put right", tenant, entries)
            continue
        if lane == OWN:
            taken += [Delivery(entry_ref(entry_id, owner), _fields(flat)) for entry_id, flat in entries]
            continue
        route = Route(lane, tenant)
        for entry_id, flat in entries:
            fields = _fields(flat)
            ref = lane_ref(entry_id, route) if shard == 0 else shard_ref(lane_ref(entry_id, route), shard)
            taken.append(Delivery(ref, fields, charged=cost_of(fields)))
    return taken


def split_rooms(rooms: tuple[int, int, int], parts: int) -> list[tuple[int, int, int]]:
    """`rooms` shared out over `parts` reads whose sum is `rooms`, the first ones a unit more where
    it does not divide: each part's rooms still shrink from lane to lower lane, as READ expects."""
    return [(*(room // parts + (j < room % parts) for room in rooms),) for j in range(parts)]  # type: ignore[misc]


def of_shard(corrections: Owed, shard: int) -> dict[tuple[str, str], int]:
    """The corrections owed to the counters of shard `shard`, as READ takes them."""
    return {(lane, tenant): tokens for (lane, tenant, owed_to), tokens in corrections.items() if owed_to == shard}


def cost_of(fields: dict[str, str]) -> int:
    """What READ charged an entry: its `cost` (as Lua's tonumber reads it), else DEFAULT_COST."""
    try:
        return int(float(fields["cost"]))
    except (KeyError, ValueError, OverflowError):
        return DEFAULT_COST


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
    at a time, so that a job placed on it waits no longer than that. `shards`: the queue's shard
    count (docs/architecture.md, "A queue over several shards"): every read, reclaim and settlement
    covers each shard's keys, named keys.shard(queue, i); one shard is the queue's own keys alone."""

    def __init__(
        self,
        client: SyncRedis,
        keys: Keys,
        queue: str,
        worker: str,
        clock: RedisClock | None = None,
        placed: bool = False,
        poll_ms: int = 50,
        shards: int = 1,
    ):
        self.redis = client
        self.keys = keys
        self.queue = queue
        self.worker = worker
        self.clock = clock or RedisClock()
        self.shard_names = shard_names(queue, shards)
        self.shard_of_stream = {keys.queue(name): i for i, name in enumerate(self.shard_names)}
        self.rings = [False] * shards  # each shard's doorbell has its group (bell_ready)
        # An idle read's look at the doorbells not yet made, in its own pipeline (_send_read): the
        # shards to look at, then what the look found, which the wait after it takes (bell_ready).
        self.looks: list[int] = []
        self.seen: dict[int, bool] = {}
        # The doorbells' entries read (shard_ref names their shard), acknowledged with the next read.
        self.bells: list[str] = []
        self.streams = QueueStreams(keys, queue)
        self.own = keys.own_queue(queue, worker) if placed else None
        self.poll_ms = poll_ms
        self.reclaim_cursors = ["0-0"] * shards
        self.reclaim_starts = [0] * shards  # where RECLAIM_LANES starts in each shard's set of lane streams
        self.read_start = 0  # the shard a read with less room than shards asks first, in turn
        # On one server of one shard READ reads this worker's own stream too: one round trip a read.
        self.own_in_read = self.own is not None and shards == 1 and not is_cluster(client)
        self.peers: list[str] = []  # every worker of the queue's index, as of the last heartbeat
        self.priority_lanes = [keys.lane(name, LANES[0]) for name in self.shard_names]  # see priority_waiting

    def _send(self, add_commands: AddCommands, per_command_errors: bool = False) -> list[Any]:
        return send_pipeline(self.redis, add_commands, per_command_errors)

    def _send_read(self, add_commands: AddCommands) -> list[Any]:
        """A read's pipeline, its replies; the first of an idle read starts with an EXISTS of each
        doorbell not yet made (`looks`), which the wait that follows an empty read needs: a round
        trip less each wait of a queue without lanes, whose doorbell is never made (bench/RESULTS.md,
        "The worker's round trips")."""
        looks, self.looks = self.looks, []
        if not looks:
            return self._send(add_commands)

        def add(pipe: Pipe) -> None:
            for shard in looks:
                consumer.add_doorbell_made(pipe, self.keys, self.shard_names[shard])
            add_commands(pipe)

        replies = self._send(add)
        self.seen = {shard: bool(made) for shard, made in zip(looks, replies)}
        return replies[len(looks) :]

    def ensure_group(self) -> None:
        # Looked up first: XGROUP CREATE is refused while Redis is out of memory, even for a group
        # that exists. From id 0, not $: jobs submitted before the first worker started run too.
        # The lanes' streams get theirs from READ, the first time it reads each; the doorbell
        # once a producer has made it (bell_ready).
        self.rings = [False] * len(self.shard_names)
        for stream in self._group_streams():
            if not self._group_exists(stream):
                consumer.create_group(self.redis, stream, make_stream=True)

    def group_exists(self) -> bool:
        return all(self._group_exists(stream) for stream in self._group_streams())

    def _group_streams(self) -> list[str]:
        shards = list(self.shard_of_stream)
        return shards if self.own is None else [self.own, *shards]

    def bell_ready(self, shard: int = 0) -> bool:
        """Whether the shard's doorbell has the group to block on: once a producer's first lane job
        made it (a queue without lanes never has one); until then a lane's first job waits for a read.
        Whether it is made is what the idle read just before found (_send_read), else asked here."""
        name = self.shard_names[shard]
        made = self.seen.pop(shard) if shard in self.seen else None
        if made is None and not self.rings[shard]:
            made = consumer.doorbell_made(self.redis, self.keys, name)
        if not self.rings[shard] and made:
            consumer.create_group(self.redis, self.keys.doorbell(name), make_stream=False)
            self.rings[shard] = True
        return self.rings[shard]

    def bells_by_shard(self, bells: list[str]) -> dict[int, list[str]]:
        """The doorbells' entries `bells` names, by shard."""
        by_shard: dict[int, list[str]] = {}
        for bell in bells:
            shard, entry_id = shard_parts(bell)
            by_shard.setdefault(shard, []).append(entry_id)
        return by_shard

    def _group_exists(self, stream: str) -> bool:
        try:
            return consumer.has_group(self.redis, stream)
        except redis.ResponseError as e:
            if is_transient(e):
                raise
            return False  # no such key: the stream is gone, and its group with it

    def read(
        self,
        rooms: tuple[int, int, int],
        block_ms: int | None,
        acks: list[str],
        dead_letters: Sequence[DeadLetter] = (),
        corrections: Owed | None = None,
    ) -> list[Delivery]:
        """Acknowledge and delete `acks`, move `dead_letters` (first in the same pipeline, so the
        pending lists never hold a finished job while new ones arrive), then read: this worker's
        own stream first (up to rooms[2], its room for any lane), then the lanes (READ: up to
        rooms[i] of lane LANES[i] or higher, of flex at most FLEX_READ_BATCH, with `corrections` for
        the lanes' counters). Idle (`block_ms`) and given nothing, it waits for a job (_wait). With
        room for priority jobs alone and nothing to settle or correct, it reads only once
        priority_waiting says there is one to read."""
        corrections = corrections or {}
        settle = Settle(acks, dead_letters, self.bells)
        self.seen = {}
        self.looks = [shard for shard, rung in enumerate(self.rings) if not rung] if block_ms is not None else []
        if rooms[0] > 0 >= rooms[1] and settle.sent and not corrections and not self.priority_waiting():
            return []
        if self.own is not None and self.own_in_read and rooms[2] > 0:
            taken = self._read_own_and_lanes(settle, self.own, rooms, corrections)
        else:
            taken, rooms = self._read_own_then_lanes(settle, rooms, corrections)
        self.bells = [b for b in self.bells if b not in settle.bells]
        if taken or block_ms is None or rooms[2] <= 0:
            return taken
        return self._wait(rooms, block_ms)

    def priority_waiting(self) -> bool:
        """Whether the priority lane of any shard holds a job nobody has read: its sorted set of active
        tenants exists (a tenant is in it exactly while its lane stream holds unread entries, and Redis
        deletes the set with its last member). What a read that can take priority jobs alone finds,
        asked of a worker full of default and priority jobs by one EXISTS instead of READ, every
        iteration (bench/RESULTS.md, "What a full worker pays to look for priority jobs"). The look
        leaves the doorbell as it is: the READs of the workers that can take the other lanes' work
        ring it while such work is left, and silence it once none is."""
        return int(self._send(lambda pipe: consumer.add_lanes_active(pipe, self.priority_lanes))[0]) > 0

    def _read_own_and_lanes(
        self, settle: Settle, own: str, rooms: tuple[int, int, int], corrections: Owed
    ) -> list[Delivery]:
        """One READ that reads this worker's own stream `own` first, after `settle` in the same pipeline."""
        lane_rooms = (rooms[0], rooms[1], min(rooms[2], FLEX_READ_BATCH))
        call = scripts.read(
            self.keys, self.queue, self.worker, lane_rooms, DEFAULT_COST, of_shard(corrections, 0), (own, rooms[2])
        )
        return lane_deliveries(self._send_read(settle.before(self, call.add_to))[-1], owner=self.worker)

    def _read_own_then_lanes(
        self, settle: Settle, rooms: tuple[int, int, int], corrections: Owed
    ) -> tuple[list[Delivery], tuple[int, int, int]]:
        """This worker's own stream, then the lanes with the rooms left, each read apart (on a
        cluster they lie on different nodes); returns what was taken and the rooms left."""
        taken: list[Delivery] = []
        own = self.own
        if own is not None and rooms[2] > 0:
            reply = self._send_read(settle.before(self, lambda pipe: self._read_into(pipe, own, rooms[2], None)))
            taken = self._entries(own, reply[-1])
            low, mid, high = (max(0, room - len(taken)) for room in rooms)
            rooms = (low, mid, high)
        if rooms[0] > 0 or corrections:
            lane_rooms = (rooms[0], rooms[1], min(rooms[2], FLEX_READ_BATCH))
            taken += self._read_lanes(settle, lane_rooms, corrections)
        elif not settle.sent:
            self._send_read(lambda pipe: settle.add_to(pipe, self))
        return taken, rooms

    def _read_lanes(self, settle: Settle, rooms: tuple[int, int, int], corrections: Owed) -> list[Delivery]:
        """READ, after `settle` in the same pipeline. On several shards, a READ per shard in one
        pipeline (one round trip per node that holds them), the rooms shared out over them so that
        the worker never takes more than it can start now; with less room than shards, the shards
        asked first take turns, and those not asked are asked next while nothing came."""
        if len(self.shard_names) == 1:
            call = scripts.read(self.keys, self.queue, self.worker, rooms, DEFAULT_COST, of_shard(corrections, 0))
            return lane_deliveries(self._send_read(settle.before(self, call.add_to))[-1])
        count = len(self.shard_names)
        order = [(self.read_start + i) % count for i in range(count)]
        self.read_start = (self.read_start + 1) % count
        taken: list[Delivery] = []
        while order and not taken:
            asked = [
                (shard, share)
                for shard, share in zip(order, split_rooms(rooms, len(order)))
                if share[0] > 0 or of_shard(corrections, shard)
            ]
            if not asked:
                break
            order = [shard for shard in order if shard not in dict(asked)]
            calls = [
                scripts.read(
                    self.keys, self.shard_names[shard], self.worker, share, DEFAULT_COST, of_shard(corrections, shard)
                )
                for shard, share in asked
            ]
            replies = self._send_read(settle.before(self, add_all(calls)))
            for (shard, _), reply in zip(asked, replies[len(replies) - len(calls) :]):
                taken += lane_deliveries(reply, shard)
        return taken

    def _wait(self, rooms: tuple[int, int, int], block_ms: int) -> list[Delivery]:
        """An idle worker's wait: one XREADGROUP of one entry from the queue's own stream, the
        doorbell and (on one server, where they share a node) this worker's own stream, so that any
        job wakes it at once; a doorbell's entry means a lane has work, which READ then takes. On a
        cluster its own stream lies on another node: it blocks for at most `poll_ms` at a time and
        then looks there."""
        one_node = not is_cluster(self.redis)
        count = len(self.shard_names)
        # On a cluster the shards lie on several nodes: it blocks on one at a time, in turn, for at
        # most poll_ms, and the next read looks at all of them.
        shards = range(count) if one_node or count == 1 else [self.read_start]
        streams: dict[str, str] = {}
        bells: dict[str, int] = {}
        for shard in shards:
            name = self.shard_names[shard]
            streams[self.keys.queue(name)] = ">"
            if self.bell_ready(shard):
                streams[self.keys.doorbell(name)] = ">"
                bells[self.keys.doorbell(name)] = shard
        if self.own is not None and one_node:
            streams[self.own] = ">"
        polls = not one_node and (self.own is not None or count > 1)
        block = min(block_ms, self.poll_ms) if polls else block_ms
        reply = self._send(lambda pipe: consumer.add_read(pipe, self.worker, streams, 1, block))[0] or []
        taken = []
        for key, entries in reply:
            if key in bells:
                self.bells += [shard_ref(entry_id, bells[key]) for entry_id, _ in entries]
            else:
                taken += self._entries(key, [(key, entries)])
        if taken:
            return taken
        if self.bells:
            return self.read(rooms, None, [])
        own = self.own
        if own is not None and not one_node:
            return self._entries(own, self._send(lambda pipe: self._read_into(pipe, own, rooms[2], None))[0])
        return []

    def _read_into(self, pipe: Pipe, stream: str, count: int, block_ms: int | None) -> None:
        consumer.add_read(pipe, self.worker, {stream: ">"}, count, block_ms)

    def _entries(self, stream: str, reply: list[Any] | None) -> list[Delivery]:
        if not reply:
            return []
        shard = self.shard_of_stream.get(stream)
        owner = None if shard is not None else self.worker
        if shard:
            return [Delivery(shard_ref(entry_id, shard), fields) for entry_id, fields in reply[0][1]]
        return [Delivery(entry_ref(entry_id, owner), fields) for entry_id, fields in reply[0][1]]

    def reclaim(self, count: int, min_idle_ms: int) -> list[Delivery]:
        """XAUTOCLAIM up to `count` entries idle longer than `min_idle_ms`: jobs of workers that
        died or stalled, in the queue's stream, then in the lanes' (RECLAIM_LANES), shard after
        shard (each scan starting at the next shard). Each scan resumes where the last one stopped,
        so every pending entry is reached in turn."""
        shards = len(self.shard_names)
        taken: list[Delivery] = []
        for i in range(shards):
            if len(taken) >= count:
                break
            taken += self._reclaim_shard((self.read_start + i) % shards, count - len(taken), min_idle_ms)
        return taken

    def _reclaim_shard(self, shard: int, count: int, min_idle_ms: int) -> list[Delivery]:
        name = self.shard_names[shard]
        call = scripts.reclaim(
            self.keys.queue(name), self.worker, min_idle_ms, self.reclaim_cursors[shard], count, HANDED_OVER_MIN_IDLE_MS
        )
        cursor, claimed = self._send(call.add_to)[0]
        self.reclaim_cursors[shard] = cursor
        taken = [
            Delivery(shard_ref(entry_id, shard), _fields(flat), n, bool(handed))
            for entry_id, flat, n, handed in claimed
        ]
        if len(taken) < count:
            left, start = count - len(taken), self.reclaim_starts[shard]
            call = scripts.reclaim_lanes(
                self.keys, name, self.worker, min_idle_ms, left, start, HANDED_OVER_MIN_IDLE_MS
            )
            self.reclaim_starts[shard], streams = self._send(call.add_to)[0]
            taken += reclaimed_lane_deliveries(streams, shard)
        return taken

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
        """Give a detached job back to its lane (REQUEUE, then a fresh entry)."""
        if not self._send(scripts.requeue(self.keys, job.id, job.run).add_to)[0]:
            return False
        shard = self.shard_names[shard_of(job.id, len(self.shard_names))]
        self._send(requeued_entry(self.keys, shard, job).add_to)
        return True

    def heartbeat(self, fields: dict[str, str | int | float], ttl_s: float, held: list[str]) -> tuple[int, list[str]]:
        """Refresh this worker's heartbeat hash, its place in the worker and queue indexes, the
        idle time of the entries it holds (REFRESH), and the Redis clock. Returns the queue depth
        and the held entries it has lost."""
        now = self.clock.now()

        def add(pipe: Pipe) -> None:
            pipe.time()
            registry.add_heartbeat(pipe, self.keys, self.queue, self.worker, fields, int(ttl_s * 1000), now)
            self.streams.add_refreshes(pipe, self.worker, by_stream)
            for stream in others:
                registry.add_shard_depth(pipe, stream)

        by_stream = self.streams.by_stream(held)
        others = list(self.shard_of_stream)[1:]  # the other shards' streams: the depth counts them too
        sent_at = self.clock.local()
        replies = self._send(add)
        self.clock.measured(sent_at, replies[0], self.clock.local())
        beat = replies[1 : 1 + registry.HEARTBEAT_COMMANDS]
        refreshes = replies[1 + registry.HEARTBEAT_COMMANDS : len(replies) - len(others)]
        depth, self.peers = registry.heartbeat_reply(beat)
        lost = [refs[i] for refs, reply in zip(by_stream.values(), refreshes) for i in reply]
        return depth + sum(replies[len(replies) - len(others) :]), lost

    def release(self, entry_ids: list[str]) -> int:
        """Hand unfinished entries over to other workers (RELEASE); returns how many were ours."""
        by_stream = self.streams.by_stream(entry_ids)
        add = self.streams.add_releases(self.worker, HANDED_OVER_IDLE_MS, by_stream)
        return sum(self._send(add)) if by_stream else 0

    def leave(self) -> None:
        """Remove this worker's heartbeat: it no longer counts as live. With placement its name
        stays in the queue's worker index (until registry.WORKER_INDEX_RETENTION_S prunes it), because that
        index is where the others find its stream: a producer whose view was read before the drain
        may still place jobs there, and they are stolen."""

        self._send(
            lambda pipe: registry.add_leave(pipe, self.keys, self.queue, self.worker, keep_name=self.own is not None)
        )


def reclaimed_lane_deliveries(streams: list[Any], shard: int = 0) -> list[Delivery]:
    """RECLAIM_LANES' reply (of shard `shard`): each entry named by its lane's reference."""
    return [
        Delivery(shard_ref(lane_ref(entry_id, Route(lane, tenant)), shard), _fields(flat), deliveries, bool(handed))
        for lane, tenant, entries in streams
        for entry_id, flat, deliveries, handed in entries
    ]


def requeued_entry(keys: Keys, queue: str, job: Job) -> ScriptCall:
    """The fresh entry of a job given back: in the queue's own stream, or its lane's (ENQUEUE_LANES)."""
    body, route = job.request.to_json(), job.route
    if route == DEFAULT_ROUTE:
        return producer.enqueue(keys.queue(queue), 0, job.id, body)
    cost = len(job.prompt_token_ids) + job.request.params.max_tokens
    return producer.enqueue_lanes(keys, queue, route.tenant, [producer.LaneJob(route.lane, cost, job.id, body)], 0)


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
