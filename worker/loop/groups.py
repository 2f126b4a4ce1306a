"""The consumer groups a worker reads the queue through, and when it makes them (docs/architecture.md)."""

from __future__ import annotations

from typing import Any

import redis

from producer_client.cluster import SyncRedis
from producer_client.keys import Keys
from producer_client.protocol import consumer
from producer_client.protocol.execution import AddCommands, Pipe
from worker.loop.queue import is_transient, send_pipeline
from worker.loop.streams import QueueShards


class ConsumerGroups:
    """Whether the streams this worker reads have its group: each shard's stream and, with placement,
    its own (`own`), made when it starts and again when Redis lost them; each shard's doorbell, made
    once a producer's first lane job made the doorbell (a queue without lanes never has one), looked
    for by an idle read in its own pipeline. Apart from the reads because this state outlives them:
    it changes when Redis loses or makes a group, not with what a read takes."""

    def __init__(self, client: SyncRedis, keys: Keys, shards: QueueShards, own: str | None):
        self.redis = client
        self.keys = keys
        self.shards = shards
        self.own = own
        self.rings = [False] * len(shards.names)  # each shard's doorbell has its group (bell_ready)
        # An idle read's look at the doorbells not yet made, in its own pipeline (send_read): the
        # shards to look at, then what the look found, which the wait after it takes (bell_ready).
        self.looks: list[int] = []
        self.seen: dict[int, bool] = {}

    def ensure(self) -> None:
        # Looked up first: XGROUP CREATE is refused while Redis is out of memory, even for a group
        # that exists. From id 0, not $: jobs submitted before the first worker started run too.
        # The lanes' streams get theirs from READ, the first time it reads each; the doorbell
        # once a producer has made it (bell_ready).
        self.rings = [False] * len(self.shards.names)
        for stream in self._streams():
            if not self._exists(stream):
                consumer.create_group(self.redis, stream, make_stream=True)

    def exist(self) -> bool:
        return all(self._exists(stream) for stream in self._streams())

    def _streams(self) -> list[str]:
        shards = list(self.shards.of_stream)
        return shards if self.own is None else [self.own, *shards]

    def _exists(self, stream: str) -> bool:
        try:
            return consumer.has_group(self.redis, stream)
        except redis.ResponseError as e:
            if is_transient(e):
                raise
            return False  # no such key: the stream is gone, and its group with it

    def look_with(self, idle: bool) -> None:
        """A read starts: if `idle` (it waits when given nothing), its first pipeline looks for the
        doorbells not yet made."""
        self.seen = {}
        self.looks = [shard for shard, rung in enumerate(self.rings) if not rung] if idle else []

    def send_read(self, add_commands: AddCommands) -> list[Any]:
        """A read's pipeline, its replies; the first of an idle read starts with an EXISTS of each
        doorbell not yet made (`looks`), which the wait that follows an empty read needs: a round
        trip less each wait of a queue without lanes, whose doorbell is never made (bench/RESULTS.md,
        "The worker's round trips")."""
        looks, self.looks = self.looks, []
        if not looks:
            return send_pipeline(self.redis, add_commands)

        def add(pipe: Pipe) -> None:
            for shard in looks:
                consumer.add_doorbell_made(pipe, self.keys, self.shards.names[shard])
            add_commands(pipe)

        replies = send_pipeline(self.redis, add)
        self.seen = {shard: bool(made) for shard, made in zip(looks, replies)}
        return replies[len(looks) :]

    def bell_ready(self, shard: int = 0) -> bool:
        """Whether the shard's doorbell has the group to block on: once a producer's first lane job
        made it (a queue without lanes never has one); until then a lane's first job waits for a read.
        Whether it is made is what the idle read just before found (send_read), else asked here."""
        name = self.shards.names[shard]
        made = self.seen.pop(shard) if shard in self.seen else None
        if made is None and not self.rings[shard]:
            made = consumer.doorbell_made(self.redis, self.keys, name)
        if not self.rings[shard] and made:
            consumer.create_group(self.redis, self.keys.doorbell(name), make_stream=False)
            self.rings[shard] = True
        return self.rings[shard]
