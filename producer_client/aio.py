"""The asyncio client: `Client`'s methods as coroutines, over redis.asyncio."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis

from producer_client import protocol
from producer_client.errors import JobNotFound, QueueFull
from producer_client.keys import DEFAULT_PREFIX, Keys, check_name
from producer_client.protocol import DEFAULT_MAX_QUEUE_DEPTH, DEFAULT_URL, EVENT_BATCH, Deadline, NewJob
from producer_client.schema import JobResult, JobStatus, QueueStats, TokenDelta
from producer_client.scripts import CANCEL_JOB


class AsyncClient:
    """See `producer_client.Client`; every method here is its awaitable twin."""

    def __init__(
        self, url: str = DEFAULT_URL, queue: str = "default", *, prefix: str = DEFAULT_PREFIX,
        max_queue_depth: int | None = DEFAULT_MAX_QUEUE_DEPTH,
    ):
        self.queue = check_name("queue", queue)
        self.keys = Keys(prefix)
        self.max_queue_depth = protocol.check_max_queue_depth(max_queue_depth)
        self.redis = aioredis.Redis.from_url(url, decode_responses=True)
        self._cancel_job = self.redis.register_script(CANCEL_JOB)

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def submit(
        self, prompt: str | None = None, *, messages: list[dict] | None = None, input_ids: list[int] | None = None,
        request_id: str | None = None, timeout_s: float | None = None, priority: int = 0, **sampling: Any,
    ) -> str:
        job = protocol.build_job(prompt, messages, input_ids, request_id, timeout_s, priority, sampling)
        await self._check_depth()
        if job.idempotent:
            if not await self.redis.hsetnx(self.keys.job(job.job_id), "status", "queued"):
                return job.job_id
            await self._enqueue_or_forget(job)
        else:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hset(self.keys.job(job.job_id), "status", "queued")
            pipe.xadd(self.keys.queue(self.queue), job.entry())
            await pipe.execute()
        return job.job_id

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        job_id = protocol.check_job_id(job_id)
        deadline = Deadline(job_id, protocol.check_timeout(timeout))
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.job(job_id), "status")
        pipe.xrevrange(self.keys.events(job_id), count=1)
        status, last = await pipe.execute()
        if status is None:
            raise JobNotFound(job_id)
        after, end = protocol.end_event(last)
        while end is None:
            for event_id, fields in await self._read_events(job_id, after, deadline):
                after = event_id
                if fields["type"] == "end":
                    end = fields["data"]
                    break
        return protocol.finished(job_id, end)

    async def stream(self, job_id: str, after: str = "0-0", timeout: float | None = None) -> AsyncIterator[TokenDelta]:
        job_id = protocol.check_job_id(job_id)
        after = protocol.check_event_id(after)
        deadline = Deadline(job_id, protocol.check_timeout(timeout))
        if not await self.redis.exists(self.keys.job(job_id)):
            raise JobNotFound(job_id)
        while True:
            for event_id, fields in await self._read_events(job_id, after, deadline):
                after = event_id
                if fields["type"] == "tokens":
                    yield protocol.token_delta(event_id, fields["data"])
                elif fields["type"] == "end":
                    protocol.finished(job_id, fields["data"])
                    return

    async def status(self, job_id: str) -> JobStatus:
        job_id = protocol.check_job_id(job_id)
        return protocol.job_status(job_id, await self.redis.hgetall(self.keys.job(job_id)))

    async def cancel(self, job_id: str) -> JobStatus:
        job_id = protocol.check_job_id(job_id)
        keys = [self.keys.job(job_id), self.keys.events(job_id)]
        if await self._cancel_job(keys=keys, args=[protocol.cancelled_result(job_id)]) is None:
            raise JobNotFound(job_id)
        return await self.status(job_id)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> JobResult:
        protocol.check_timeout(timeout)
        return await self.result(await self.submit(prompt, **kwargs), timeout=timeout)

    async def queue_stats(self) -> QueueStats:
        queue_key = self.keys.queue(self.queue)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xlen(queue_key)
        pipe.zrange(self.keys.workers(self.queue), 0, -1)
        depth, names = await pipe.execute()
        if depth:
            pipe.xinfo_groups(queue_key)
        for name in names:
            pipe.exists(self.keys.worker(name))
        replies = await pipe.execute()
        groups = replies.pop(0) if depth else []
        return protocol.queue_stats(self.queue, depth, groups, names, replies)

    async def _check_depth(self) -> None:
        if self.max_queue_depth is not None:
            depth = await self.redis.xlen(self.keys.queue(self.queue))
            if depth >= self.max_queue_depth:
                raise QueueFull(self.queue, depth, self.max_queue_depth)

    async def _enqueue_or_forget(self, job: NewJob) -> None:
        try:
            await self.redis.xadd(self.keys.queue(self.queue), job.entry())
        except BaseException:
            await self.redis.delete(self.keys.job(job.job_id))
            raise

    async def _read_events(self, job_id: str, after: str, deadline: Deadline) -> list:
        reply = await self.redis.xread(
            {self.keys.events(job_id): after}, count=EVENT_BATCH, block=deadline.block_ms()
        )
        if not reply:
            raise deadline.expired()
        return reply[0][1]
