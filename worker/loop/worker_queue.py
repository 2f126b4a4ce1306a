"""The worker's side of protocol v1 on the queue's keys (its streams, consumer groups, dead
letters, worker index): every command the queue loop sends there, batched so that one loop
iteration costs a few round trips, each pipeline sent and its replies classified by
queue.send_pipeline."""

from __future__ import annotations

from producer_client.cluster import SyncRedis
from producer_client.keys import Keys
from worker.loop.groups import ConsumerGroups
from worker.loop.membership import Membership
from worker.loop.queue import RedisClock
from worker.loop.reads import QueueReads
from worker.loop.reclaims import Reclaims
from worker.loop.streams import QueueShards


class WorkerQueue:
    """The Redis commands on the queue's keys, one part per kind of state: `groups` (whether the
    streams it reads have its group), `reads` (what it takes each iteration, and its idle wait),
    `reclaims` (the scans for entries others no longer serve), `members` (its heartbeat and its
    leaving). `placed`: this worker reads a stream of its own before the shared one (cache-aware
    placement: docs/architecture.md); on a cluster an idle worker looks there every `poll_ms`.
    `shards`: the queue's shard count (docs/architecture.md, "A queue over several shards"): every
    read, reclaim and settlement covers each shard's keys."""

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
        self.worker = worker
        self.shards = QueueShards(keys, queue, shards)
        clock = clock or RedisClock()
        own = keys.own_queue(queue, worker) if placed else None
        self.groups = ConsumerGroups(client, keys, self.shards, own)
        self.reads = QueueReads(client, keys, queue, worker, self.shards, self.groups, clock, own, poll_ms)
        self.reclaims = Reclaims(client, keys, queue, worker, self.shards)
        self.members = Membership(client, keys, queue, worker, self.shards, clock, placed)
