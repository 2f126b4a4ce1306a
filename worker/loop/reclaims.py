"""How a worker takes over the entries of workers that died, stalled or drained: the reclaim scans of
the queue's and the lanes' streams, and the take-over of another worker's own stream (cache-aware
placement: docs/architecture.md)."""

from __future__ import annotations

from typing import Any

from producer_client.cluster import SyncRedis
from producer_client.keys import Keys
from producer_client.protocol import worker as scripts
from producer_client.protocol.backlog import shard_ref
from producer_client.protocol.execution import Pipe
from worker.loop.intake import Delivery
from worker.loop.queue import HANDED_OVER_MIN_IDLE_MS, send_pipeline
from worker.loop.streams import QueueShards, QueueStreams, Route, entry_ref, fields_of, lane_ref


class Reclaims:
    """The scans for entries someone else holds and no longer serves. Each scan resumes where the
    last one stopped (the XAUTOCLAIM cursor of each shard's stream, the place in each shard's set of
    lane streams), so every pending entry is reached in turn. Apart from the reads: these take
    entries already delivered, and their state is where the scans stand, not what a read owes."""

    def __init__(self, client: SyncRedis, keys: Keys, queue: str, worker: str, shards: QueueShards):
        self.redis = client
        self.keys = keys
        self.worker = worker
        self.shards = shards
        self.streams = QueueStreams(keys, queue)
        self.cursors = ["0-0"] * len(shards.names)
        self.lane_starts = [0] * len(shards.names)  # where RECLAIM_LANES starts in each shard's set of lane streams

    def reclaim(self, count: int, min_idle_ms: int) -> list[Delivery]:
        """XAUTOCLAIM up to `count` entries idle longer than `min_idle_ms`: jobs of workers that
        died or stalled, in the queue's stream, then in the lanes' (RECLAIM_LANES), shard after
        shard (each scan starting at the next shard)."""
        shards = len(self.shards.names)
        taken: list[Delivery] = []
        for i in range(shards):
            if len(taken) >= count:
                break
            taken += self._reclaim_shard((self.shards.first + i) % shards, count - len(taken), min_idle_ms)
        return taken

    def _reclaim_shard(self, shard: int, count: int, min_idle_ms: int) -> list[Delivery]:
        name = self.shards.names[shard]
        call = scripts.reclaim(
            self.keys.queue(name), self.worker, min_idle_ms, self.cursors[shard], count, HANDED_OVER_MIN_IDLE_MS
        )
        cursor, claimed = send_pipeline(self.redis, call.add_to)[0]
        self.cursors[shard] = cursor
        taken = [
            Delivery(shard_ref(entry_id, shard), fields_of(flat), n, bool(handed))
            for entry_id, flat, n, handed in claimed
        ]
        if len(taken) < count:
            left, start = count - len(taken), self.lane_starts[shard]
            call = scripts.reclaim_lanes(
                self.keys, name, self.worker, min_idle_ms, left, start, HANDED_OVER_MIN_IDLE_MS
            )
            self.lane_starts[shard], streams = send_pipeline(self.redis, call.add_to)[0]
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
        reclaimed, stolen = send_pipeline(self.redis, call.add_to)[0]
        return (
            [Delivery(entry_ref(i, owner), fields_of(flat), n, bool(handed)) for i, flat, n, handed in reclaimed],
            [Delivery(entry_ref(i, owner), fields_of(flat)) for i, flat in stolen],
        )

    def takeable(self, owners: list[str], min_idle_ms: int, steal_before_ms: dict[str, int]) -> list[bool | Exception]:
        """TAKEABLE on each owner's stream, in one pipeline: whether TAKE_OVER would take anything
        there, or the error that stream gave (a producer may write it) in its place."""

        def add(pipe: Pipe) -> None:
            for owner in owners:
                scripts.takeable(self.streams.of(owner), min_idle_ms, steal_before_ms[owner]).add_to(pipe)

        replies = send_pipeline(self.redis, add, per_command_errors=True)
        return [r if isinstance(r, Exception) else r == 1 for r in replies]


def reclaimed_lane_deliveries(streams: list[Any], shard: int = 0) -> list[Delivery]:
    """RECLAIM_LANES' reply (of shard `shard`): each entry named by its lane's reference."""
    return [
        Delivery(shard_ref(lane_ref(entry_id, Route(lane, tenant)), shard), fields_of(flat), deliveries, bool(handed))
        for lane, tenant, entries in streams
        for entry_id, flat, deliveries, handed in entries
    ]
