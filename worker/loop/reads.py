"""How a worker reads the queue: its own stream, the lanes' (READ), and, idle, the wait for a job
(docs/architecture.md, "Sharing rules" and "A queue over several shards"). Each read first settles
what the last ones took, in the same pipeline."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from producer_client.cluster import SyncRedis, is_cluster
from producer_client.keys import LANES, Keys
from producer_client.protocol import consumer
from producer_client.protocol import worker as scripts
from producer_client.protocol.backlog import shard_parts, shard_ref
from producer_client.protocol.execution import AddCommands, Pipe
from producer_client.protocol.lanes import DEFAULT_COST
from producer_client.protocol.look_ahead import LookAhead
from producer_client.protocol.script import add_all
from worker.loop.fairness import Owed
from worker.loop.groups import ConsumerGroups
from worker.loop.intake import Delivery
from worker.loop.outbox import DeadLetter
from worker.loop.queue import RedisClock, send_pipeline
from worker.loop.streams import QueueShards, QueueStreams, Route, entry_ref, fields_of, lane_ref

log = logging.getLogger(__name__)

REFUSED = "!"  # READ's reply for a lane stream that refused (a key of another type)
OWN = "own"  # READ's reply for the entries of the worker's own stream, where READ reads it
# The most flex entries one READ takes, however much room the worker has: the entries read are
# parsed, claimed and started in the iteration that read them, and a default or priority job that
# arrives meanwhile is read at the next one. Behind a flood of short flex jobs, which start together
# and end together, a worker with 256 free slots read 256 flex entries at once, and a default job's
# wait grew with that iteration (bench/RESULTS.md, "Sharing rules"). Flex alone, as flex is the lane
# that waits for the others: a read of the default or priority lane still takes all the room, so a
# bulk load of default jobs keeps its throughput. While a higher lane is served on a loop bound by
# its host work, fewer (flex_pace.py).
FLEX_READ_BATCH = 16


class Settle:
    """What a read sends before it reads, once: acknowledgements (and deletes) of settled entries,
    dead letters, and the doorbell's entries this worker was woken by."""

    def __init__(self, acks: list[str], dead_letters: Sequence[DeadLetter], bells: list[str]):
        self.acks, self.dead_letters, self.bells = list(acks), list(dead_letters), list(bells)
        self.sent = not (self.acks or self.dead_letters or self.bells)

    def add_to(self, pipe: Pipe, reads: QueueReads) -> None:
        if self.sent:
            return
        reads.streams.add_acks(pipe, self.acks)
        for shard, bells in bells_by_shard(self.bells).items():
            consumer.add_bells_answered(pipe, reads.keys, reads.shard_names[shard], bells)
        now = reads.clock.now()
        for letter in self.dead_letters:
            reads.streams.add_dead_letter(pipe, letter.entry_id, letter.letter(reads.worker, now))
        self.sent = True

    def before(self, reads: QueueReads, add: AddCommands) -> AddCommands:
        """`add`, with this settlement first in the same pipeline (unless it went already)."""

        def both(pipe: Pipe) -> None:
            self.add_to(pipe, reads)
            add(pipe)

        return both


class QueueReads:
    """The reads of the entries this worker takes, each after the settlement of those it is done
    with, and the doorbells' entries it was woken by, answered with the next read. `own`: with
    placement, this worker reads a stream of its own before the shared one (docs/architecture.md).
    While idle it blocks on both at once on one server; on a cluster, where they lie on different
    nodes, it blocks on the shared one for at most `poll_ms` at a time, so that a job placed on it
    waits no longer than that. Apart from the reclaim scans and the groups: a read takes only what
    nobody has read, every loop iteration, and its state is what that iteration owes the next."""

    def __init__(
        self,
        client: SyncRedis,
        keys: Keys,
        queue: str,
        worker: str,
        shards: QueueShards,
        groups: ConsumerGroups,
        clock: RedisClock,
        own: str | None,
        poll_ms: int,
    ):
        self.redis = client
        self.keys = keys
        self.shards = shards
        self.shard_names = shards.names
        self.queue = queue
        self.worker = worker
        self.groups = groups
        self.clock = clock
        self.streams = QueueStreams(keys, queue)
        self.own = own
        self.poll_ms = poll_ms
        # The doorbells' entries read (shard_ref names their shard), acknowledged with the next read.
        self.bells: list[str] = []
        # On one server of one shard READ reads this worker's own stream too: one round trip a read.
        self.own_in_read = own is not None and len(shards.names) == 1 and not is_cluster(client)
        self.priority_lanes = [keys.lane(name, LANES[0]) for name in shards.names]  # see priority_waiting
        self.default_lanes = [keys.lane(name, LANES[1]) for name in shards.names]  # see higher_lanes_look
        # The look of a full worker sent ahead, after its step (look_ahead), on one server.
        self.ahead = None if is_cluster(client) else LookAhead(client, self.priority_lanes)
        self.full = False  # the last read was a full worker's look

    def _send(self, add_commands: AddCommands) -> list[Any]:
        return send_pipeline(self.redis, add_commands)

    def read(
        self,
        rooms: tuple[int, int, int],
        block_ms: int | None,
        acks: list[str],
        dead_letters: Sequence[DeadLetter] = (),
        corrections: Owed | None = None,
        flex_batch: int = FLEX_READ_BATCH,
    ) -> list[Delivery]:
        """Acknowledge and delete `acks`, move `dead_letters` (first in the same pipeline, so the
        pending lists never hold a finished job while new ones arrive), then read: this worker's
        own stream first (up to rooms[2], its room for any lane), then the lanes (READ: up to
        rooms[i] of lane LANES[i] or higher, of flex at most `flex_batch` (flex_pace.py), with
        `corrections` for the lanes' counters). Idle (`block_ms`) and given nothing, it waits for a job (_wait). With
        room for priority jobs alone and nothing to settle or correct, it reads only once
        priority_waiting (or the look sent ahead since the last read) says there is one to read."""
        ahead = self.ahead.answer() if self.ahead is not None else None
        corrections = corrections or {}
        settle = Settle(acks, dead_letters, self.bells)
        self.groups.look_with(block_ms is not None)
        self.full = rooms[0] > 0 >= rooms[1] and settle.sent and not corrections
        if self.full and not (self.priority_waiting() if ahead is None else ahead):
            return []
        if self.own is not None and self.own_in_read and rooms[2] > 0:
            taken = self._read_own_and_lanes(settle, self.own, rooms, corrections, flex_batch)
        else:
            taken, rooms = self._read_own_then_lanes(settle, rooms, corrections, flex_batch)
        self.bells = [b for b in self.bells if b not in settle.bells]
        if taken or block_ms is None or rooms[2] <= 0:
            return taken
        return self._wait(rooms, block_ms, flex_batch)

    def look_ahead(self) -> None:
        """A full worker's next look, sent now for the next read to find answered: called once an
        engine step's outputs are collected, it sees what the look at the next read's start would,
        but for what arrives during the publication between them (read an iteration later), and its
        round trip runs while the loop publishes instead of as a wait of its own (bench/RESULTS.md).
        Only while the last read was such a look: a worker with room for other jobs reads them anyway."""
        if self.full and self.ahead is not None:
            self.ahead.send()

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()

    def priority_waiting(self) -> bool:
        """Whether the priority lane of any shard holds a job nobody has read: its sorted set of active
        tenants exists (a tenant is in it exactly while its lane stream holds unread entries, and Redis
        deletes the set with its last member). What a read that can take priority jobs alone finds,
        asked of a worker full of default and priority jobs by one EXISTS instead of READ, every
        iteration (bench/RESULTS.md, "What a full worker pays to look for priority jobs"). The look
        leaves the doorbell as it is: the READs of the workers that can take the other lanes' work
        ring it while such work is left, and silence it once none is."""
        return int(self._send(lambda pipe: consumer.add_lanes_active(pipe, self.priority_lanes))[0]) > 0

    def higher_lanes_look(self, rooms: tuple[int, int, int]) -> AddCommands | None:
        """A look (one EXISTS, what priority_waiting asks) at the lanes above flex that `rooms` has
        room for, to send with the claim of flex entries just read, on one server (None: no such
        room, or a cluster, where the lanes' keys lie on other nodes than the jobs'). A job of those
        lanes that arrived after the READ that took the flex entries is then read in the same loop
        iteration (read_higher_lanes), not after its engine step and publication and the next
        READ: behind a flex flood that iteration was most of a default job's wait (bench/RESULTS.md,
        "A default job behind a flex flood read in the iteration it arrives in")."""
        if is_cluster(self.redis):
            return None
        lanes = (self.priority_lanes if rooms[0] > 0 else []) + (self.default_lanes if rooms[1] > 0 else [])
        if not lanes:
            return None
        return lambda pipe: consumer.add_lanes_active(pipe, lanes)

    def read_higher_lanes(self, rooms: tuple[int, int, int]) -> list[Delivery]:
        """READ of the priority and default lanes alone, up to `rooms` (flex gets none): after a look
        found work there. Nothing to settle: the iteration's read settled it."""
        return self._read_lanes(Settle([], (), []), (rooms[0], rooms[1], 0), {})

    def _read_own_and_lanes(
        self, settle: Settle, own: str, rooms: tuple[int, int, int], corrections: Owed, flex_batch: int
    ) -> list[Delivery]:
        """One READ that reads this worker's own stream `own` first, after `settle` in the same pipeline."""
        lane_rooms = (rooms[0], rooms[1], min(rooms[2], flex_batch))
        call = scripts.read(
            self.keys, self.queue, self.worker, lane_rooms, DEFAULT_COST, of_shard(corrections, 0), (own, rooms[2])
        )
        return lane_deliveries(self.groups.send_read(settle.before(self, call.add_to))[-1], owner=self.worker)

    def _read_own_then_lanes(
        self, settle: Settle, rooms: tuple[int, int, int], corrections: Owed, flex_batch: int
    ) -> tuple[list[Delivery], tuple[int, int, int]]:
        """This worker's own stream, then the lanes with the rooms left, each read apart (on a
        cluster they lie on different nodes); returns what was taken and the rooms left."""
        taken: list[Delivery] = []
        own = self.own
        if own is not None and rooms[2] > 0:
            reply = self.groups.send_read(settle.before(self, lambda pipe: self._read_into(pipe, own, rooms[2], None)))
            taken = self._entries(own, reply[-1])
            low, mid, high = (max(0, room - len(taken)) for room in rooms)
            rooms = (low, mid, high)
        if rooms[0] > 0 or corrections:
            lane_rooms = (rooms[0], rooms[1], min(rooms[2], flex_batch))
            taken += self._read_lanes(settle, lane_rooms, corrections)
        elif not settle.sent:
            self.groups.send_read(lambda pipe: settle.add_to(pipe, self))
        return taken, rooms

    def _read_lanes(self, settle: Settle, rooms: tuple[int, int, int], corrections: Owed) -> list[Delivery]:
        """READ, after `settle` in the same pipeline. On several shards, a READ per shard in one
        pipeline (one round trip per node that holds them), the rooms shared out over them so that
        the worker never takes more than it can start now; with less room than shards, the shards
        asked first take turns, and those not asked are asked next while nothing came."""
        if len(self.shard_names) == 1:
            call = scripts.read(self.keys, self.queue, self.worker, rooms, DEFAULT_COST, of_shard(corrections, 0))
            return lane_deliveries(self.groups.send_read(settle.before(self, call.add_to))[-1])
        count = len(self.shard_names)
        order = [(self.shards.first + i) % count for i in range(count)]
        self.shards.first = (self.shards.first + 1) % count
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
            replies = self.groups.send_read(settle.before(self, add_all(calls)))
            for (shard, _), reply in zip(asked, replies[len(replies) - len(calls) :]):
                taken += lane_deliveries(reply, shard)
        return taken

    def _wait(self, rooms: tuple[int, int, int], block_ms: int, flex_batch: int) -> list[Delivery]:
        """An idle worker's wait: one XREADGROUP of one entry from the queue's own stream, the
        doorbell and (on one server, where they share a node) this worker's own stream, so that any
        job wakes it at once; a doorbell's entry means a lane has work, which READ then takes. On a
        cluster its own stream lies on another node: it blocks for at most `poll_ms` at a time and
        then looks there."""
        one_node = not is_cluster(self.redis)
        count = len(self.shard_names)
        # On a cluster the shards lie on several nodes: it blocks on one at a time, in turn, for at
        # most poll_ms, and the next read looks at all of them.
        shards = range(count) if one_node or count == 1 else [self.shards.first]
        streams: dict[str, str] = {}
        bells: dict[str, int] = {}
        for shard in shards:
            name = self.shard_names[shard]
            streams[self.keys.queue(name)] = ">"
            if self.groups.bell_ready(shard):
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
            return self.read(rooms, None, [], flex_batch=flex_batch)
        own = self.own
        if own is not None and not one_node:
            return self._entries(own, self._send(lambda pipe: self._read_into(pipe, own, rooms[2], None))[0])
        return []

    def _read_into(self, pipe: Pipe, stream: str, count: int, block_ms: int | None) -> None:
        consumer.add_read(pipe, self.worker, {stream: ">"}, count, block_ms)

    def _entries(self, stream: str, reply: list[Any] | None) -> list[Delivery]:
        if not reply:
            return []
        shard = self.shards.of_stream.get(stream)
        owner = None if shard is not None else self.worker
        if shard:
            return [Delivery(shard_ref(entry_id, shard), fields) for entry_id, fields in reply[0][1]]
        return [Delivery(entry_ref(entry_id, owner), fields) for entry_id, fields in reply[0][1]]


def bells_by_shard(bells: list[str]) -> dict[int, list[str]]:
    """The doorbells' entries `bells` names, by shard."""
    by_shard: dict[int, list[str]] = {}
    for bell in bells:
        shard, entry_id = shard_parts(bell)
        by_shard.setdefault(shard, []).append(entry_id)
    return by_shard


def lane_deliveries(reply: list[Any], shard: int = 0, owner: str | None = None) -> list[Delivery]:
    """READ's reply (of shard `shard`): each entry named by its lane's reference and charged its cost;
    those of `owner`'s own stream, which READ read first where it was given it, by their stream's."""
    taken: list[Delivery] = []
    for lane, tenant, entries in reply:
        if lane == REFUSED:
            log.error("the lane stream %s refused a read (%s): its jobs wait until it is put right", tenant, entries)
            continue
        if lane == OWN:
            taken += [Delivery(entry_ref(entry_id, owner), fields_of(flat)) for entry_id, flat in entries]
            continue
        route = Route(lane, tenant)
        for entry_id, flat in entries:
            fields = fields_of(flat)
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
