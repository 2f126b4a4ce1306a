"""The worker's side of protocol v1: every Redis command the queue loop sends, batched so
that one loop iteration costs at most three round trips (read, claim, publish)."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import redis

from producer_client.keys import GROUP, Keys
from producer_client.schema import JobResult
from producer_client.scripts import CLAIM_JOB, FINISH_JOB

# Names of workers whose heartbeat is this stale are dropped from the queue's worker index.
WORKER_INDEX_RETENTION_S = 3600


@dataclass
class Finish:
    job_id: str
    entry_id: str
    result: JobResult


@dataclass
class TokenEvent:
    job_id: str
    data: str  # JSON: ids, text, logprobs
    tokens_so_far: int


@dataclass
class Batch:
    """What one loop iteration has to tell Redis, sent in one pipeline."""

    tokens: list[TokenEvent] = field(default_factory=list)
    finishes: list[Finish] = field(default_factory=list)
    watch: list[str] = field(default_factory=list)  # running jobs whose cancel flag to read


@dataclass
class Published:
    # Results now final in Redis, each with whether this call wrote it (False: an earlier
    # finisher did, and this one changed nothing). Either way the entry may be acknowledged.
    finished: list[tuple[Finish, bool]]
    cancelled: list[str]  # watched jobs whose cancel flag is set


class WorkerQueue:
    def __init__(self, client: redis.Redis, keys: Keys, queue: str, worker: str, result_ttl_s: int):
        self.redis = client
        self.keys = keys
        self.queue = queue
        self.worker = worker
        self.result_ttl_s = result_ttl_s
        self.stream = keys.queue(queue)
        self._claim = client.register_script(CLAIM_JOB)
        self._finish = client.register_script(FINISH_JOB)

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
        """For each (job id, entry id): 'claimed', 'final' or 'duplicate' (see CLAIM_JOB)."""
        pipe = self.redis.pipeline(transaction=False)
        start = json.dumps({"worker": self.worker, "started_at": time.time()})
        for job_id, entry_id in jobs:
            self._claim(
                keys=[self.keys.job(job_id), self.keys.events(job_id)],
                args=[self.worker, entry_id, start, self.result_ttl_s], client=pipe,
            )
        return pipe.execute()

    def publish(self, batch: Batch) -> Published:
        """Token events, final results and cancel checks of one step, in one pipeline. Raises
        on any Redis error, so a result that was not written is never acknowledged."""
        pipe = self.redis.pipeline(transaction=False)
        for ev in batch.tokens:
            pipe.xadd(self.keys.events(ev.job_id), {"type": "tokens", "data": ev.data})
            pipe.hset(self.keys.job(ev.job_id), "tokens", ev.tokens_so_far)
        for f in batch.finishes:
            self._finish(
                keys=[self.keys.job(f.job_id), self.keys.events(f.job_id)],
                args=[f.result.status, f.result.model_dump_json(), len(f.result.token_ids), self.result_ttl_s],
                client=pipe,
            )
        for job_id in batch.watch:
            pipe.hget(self.keys.job(job_id), "cancel")
        replies = pipe.execute() if len(pipe) else []
        written = replies[2 * len(batch.tokens): 2 * len(batch.tokens) + len(batch.finishes)]
        flags = replies[len(replies) - len(batch.watch):]
        return Published(
            finished=[(f, bool(w)) for f, w in zip(batch.finishes, written)],
            cancelled=[job_id for job_id, flag in zip(batch.watch, flags) if flag == "1"],
        )

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
