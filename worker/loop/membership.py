"""A worker's place among the queue's workers: how it tells it is alive and how it leaves
(docs/architecture.md)."""

from __future__ import annotations

import redis

from producer_client.cluster import SyncRedis
from producer_client.connection import is_other_type
from producer_client.keys import Keys
from producer_client.protocol import producer, registry
from producer_client.protocol import worker as scripts
from producer_client.protocol.execution import Pipe
from producer_client.protocol.script import ScriptCall
from producer_client.protocol.shards import shard_of
from worker.loop.jobs import Job
from worker.loop.queue import HANDED_OVER_IDLE_MS, RedisClock, send_pipeline
from worker.loop.streams import DEFAULT_ROUTE, QueueShards, QueueStreams


class Membership:
    """This worker's presence in the queue: its heartbeat, which refreshes the entries it holds and
    brings back the queue's depth, the entries it lost, the queue's workers (`peers`) and Redis's
    clock; and its leaving: its entries handed over (RELEASE), its detached jobs given back to their
    lanes (REQUEUE), its heartbeat removed. Apart from the reads and reclaims: these speak for the
    worker as a whole, on the worker index and its heartbeat, once a heartbeat or once at the end."""

    def __init__(
        self,
        client: SyncRedis,
        keys: Keys,
        queue: str,
        worker: str,
        shards: QueueShards,
        clock: RedisClock,
        placed: bool,
    ):
        self.redis = client
        self.keys = keys
        self.queue = queue
        self.worker = worker
        self.shards = shards
        self.clock = clock
        self.placed = placed
        self.streams = QueueStreams(keys, queue)
        self.peers: list[str] = []  # every worker of the queue's index, as of the last heartbeat

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
        others = list(self.shards.of_stream)[1:]  # the other shards' streams: the depth counts them too
        sent_at = self.clock.local()
        try:
            replies = send_pipeline(self.redis, add)
        except redis.ResponseError as error:
            # A registry key of another type failed the whole heartbeat, and with it every exchange
            # the worker retries with backoff: it served no job until someone deleted the key.
            if not is_other_type(error) or not self.registry_made_anew():
                raise
            sent_at = self.clock.local()
            replies = send_pipeline(self.redis, add)
        self.clock.measured(sent_at, replies[0], self.clock.local())
        beat = replies[1 : 1 + registry.HEARTBEAT_COMMANDS]
        refreshes = replies[1 + registry.HEARTBEAT_COMMANDS : len(replies) - len(others)]
        depth, self.peers = registry.heartbeat_reply(beat)
        lost = [refs[i] for refs, reply in zip(by_stream.values(), refreshes) for i in reply]
        return depth + sum(replies[len(replies) - len(others) :]), lost

    def registry_made_anew(self) -> bool:
        """Delete those of the heartbeat's registry keys that hold another type, which the heartbeat
        then writes anew (registry.heartbeat_key_types); whether there was any. A WRONGTYPE from
        another of its keys (the queue's stream: left to whoever made it so) finds none here."""
        kinds = registry.heartbeat_key_types(self.keys, self.queue, self.worker)
        found = send_pipeline(self.redis, lambda pipe: registry.add_types(pipe, list(kinds)))
        wrong = [key for (key, kind), held in zip(kinds.items(), found) if held not in (kind, "none")]
        if wrong:
            send_pipeline(self.redis, lambda pipe: registry.add_deletes(pipe, wrong))
        return bool(wrong)

    def release(self, entry_ids: list[str]) -> int:
        """Hand unfinished entries over to other workers (RELEASE); returns how many were ours."""
        by_stream = self.streams.by_stream(entry_ids)
        add = self.streams.add_releases(self.worker, HANDED_OVER_IDLE_MS, by_stream)
        return sum(send_pipeline(self.redis, add)) if by_stream else 0

    def requeue(self, job: Job) -> bool:
        """Give a detached job back to its lane (REQUEUE, then a fresh entry)."""
        if not send_pipeline(self.redis, scripts.requeue(self.keys, job.id, job.run).add_to)[0]:
            return False
        shard = self.shards.names[shard_of(job.id, len(self.shards.names))]
        send_pipeline(self.redis, requeued_entry(self.keys, shard, job).add_to)
        return True

    def leave(self) -> None:
        """Remove this worker's heartbeat: it no longer counts as live. With placement its name
        stays in the queue's worker index (until registry.WORKER_INDEX_RETENTION_S prunes it), because that
        index is where the others find its stream: a producer whose view was read before the drain
        may still place jobs there, and they are stolen."""

        send_pipeline(
            self.redis,
            lambda pipe: registry.add_leave(pipe, self.keys, self.queue, self.worker, keep_name=self.placed),
        )


def requeued_entry(keys: Keys, queue: str, job: Job) -> ScriptCall:
    """The fresh entry of a job given back: in the queue's own stream, or its lane's (ENQUEUE_LANES)."""
    body, route = job.request.to_json(), job.route
    if route == DEFAULT_ROUTE:
        return producer.enqueue(keys.queue(queue), 0, job.id, body)
    cost = len(job.prompt_token_ids) + job.request.params.max_tokens
    return producer.enqueue_lanes(keys, queue, route.tenant, [producer.LaneJob(route.lane, cost, job.id, body)], 0)
