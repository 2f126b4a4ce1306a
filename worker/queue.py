"""The worker's side of protocol v1: every Redis command the queue loop sends, batched so
that one loop iteration costs at most three round trips (read, claim, publish)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from producer_client import scripts
from producer_client.keys import GROUP, Keys
from producer_client.protocol import job_keys
from producer_client.schema import JobResult
from producer_client.scripts import CLAIM, PUBLISH

# Names of workers whose heartbeat is this stale are dropped from the queue's worker index.
WORKER_INDEX_RETENTION_S = 3600


@dataclass
class Update:
    """What one job publishes for one step: each part is optional ('' or None when absent)."""

    job_id: str
    entry_id: str
    start: str = ""  # start event JSON: the first publication after the claim
    tokens: str = ""  # tokens event JSON: ids, text, logprobs
    tokens_so_far: int = 0
    final: JobResult | None = None


@dataclass
class Batch:
    """What one loop iteration has to tell Redis, sent in one pipeline."""

    updates: dict[str, Update] = field(default_factory=dict)
    watch: list[str] = field(default_factory=list)  # running jobs with no update: read their cancel flag

    def update(self, job_id: str, entry_id: str) -> Update:
        if job_id not in self.updates:
            self.updates[job_id] = Update(job_id, entry_id)
        return self.updates[job_id]


@dataclass
class Published:
    # Results now final in Redis, each with whether this call wrote it (False: an earlier
    # finisher did, and this one changed nothing). Either way the entry may be acknowledged.
    finished: list[tuple[Update, bool]]
    stop: list[str]  # running jobs to stop: cancelled, or already given a result elsewhere


class WorkerQueue:
    def __init__(self, client: redis.Redis, keys: Keys, queue: str, worker: str, result_ttl_s: int):
        self.redis = client
        self.keys = keys
        self.queue = queue
        self.worker = worker
        self.result_ttl_s = result_ttl_s
        self.stream = keys.queue(queue)

    def ensure_group(self) -> None:
        # From id 0, not $: jobs submitted before the first worker started must run too.
        try:
            self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read(self, count: int, block_ms: int | None, acks: list[str]) -> list[tuple[str, dict[str, str]]]:
        """Acknowledge and delete `acks`, then read up to `count` new entries. The acks go
        first in the same pipeline, so the pending list never holds a finished job while
        new ones arrive: pending entries <= the engine's slots."""
        pipe = self.redis.pipeline(transaction=False)
        if acks:
            pipe.xack(self.stream, GROUP, *acks)
            pipe.xdel(self.stream, *acks)
        if count > 0:
            pipe.xreadgroup(GROUP, self.worker, {self.stream: ">"}, count=count, block=block_ms)
        if len(pipe) == 0:
            return []
        replies = pipe.execute()
        if count <= 0 or not replies[-1]:
            return []
        return replies[-1][0][1]

    def claim(self, jobs: list[tuple[str, str]]) -> list[str]:
        """For each (job id, entry id): 'claimed', 'final' or 'duplicate' (see CLAIM)."""

        def add(pipe):
            for job_id, entry_id in jobs:
                pipe.evalsha(CLAIM.sha, 3, *job_keys(self.keys, job_id), self.worker, entry_id, self.result_ttl_s)

        return scripts.execute(self.redis, add)

    def publish(self, batch: Batch) -> Published:
        """Every job's events of one step, final results and cancel checks, in one pipeline.
        Raises on any Redis error, so a result that was not written is never acknowledged."""
        updates = list(batch.updates.values())
        finals = [(u.final.status, u.final.model_dump_json()) if u.final else ("", "") for u in updates]

        def add(pipe):
            for u, final in zip(updates, finals):
                pipe.evalsha(
                    PUBLISH.sha, 3, *job_keys(self.keys, u.job_id), u.start, u.tokens, u.tokens_so_far, *final,
                    self.result_ttl_s,
                )
            for job_id in batch.watch:
                pipe.hget(self.keys.job(job_id), "cancel")

        replies = scripts.execute(self.redis, add)
        finished, stop = [], []
        for u, reply in zip(updates, replies):
            if u.final is not None:
                finished.append((u, reply == 1))
            elif reply == "1" or reply == 0:  # cancel flag, or a result written elsewhere
                stop.append(u.job_id)
        stop.extend(job_id for job_id, flag in zip(batch.watch, replies[len(updates):]) if flag == "1")
        return Published(finished, stop)

    def heartbeat(self, fields: dict[str, str | int | float], ttl_s: float) -> int:
        """Refresh this worker's heartbeat hash and index entry; returns the queue depth."""
        key = self.keys.worker(self.worker)
        index = self.keys.workers(self.queue)
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(key, mapping=fields)
        pipe.pexpire(key, int(ttl_s * 1000))
        pipe.zadd(index, {self.worker: now})
        pipe.zremrangebyscore(index, "-inf", now - WORKER_INDEX_RETENTION_S)
        pipe.xlen(self.stream)
        return pipe.execute()[-1]

    def leave(self) -> None:
        """Remove this worker's heartbeat: it no longer counts as live."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.worker))
        pipe.zrem(self.keys.workers(self.queue), self.worker)
        pipe.execute()
