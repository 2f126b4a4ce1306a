"""The asyncio client: `Client`'s methods as coroutines, over redis.asyncio, in any of the three
modes (producer_client.connection)."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any

import redis

from producer_client import bulk, core, steps
from producer_client.bulk import ResultWatch
from producer_client.cluster import is_cluster
from producer_client.connection import async_retry_policy, connect_async, parse_url
from producer_client.core import DEFAULT_MAX_QUEUE_DEPTH, DEFAULT_URL, EVENT_BATCH, Deadline, NewJob, Replication
from producer_client.errors import JobNotFound, JobTimeout, QueueFull
from producer_client.job_stream import JobStream
from producer_client.keys import DEFAULT_PREFIX, Keys, check_name
from producer_client.operator_views import OperatorViews
from producer_client.placement import Placement
from producer_client.protocol import execution
from producer_client.protocol import producer as scripts
from producer_client.schema import JobResult, JobStatus, QueueStats, TokenDelta, WorkerInfo


class AsyncClient(OperatorViews):
    """See `producer_client.Client`; every method here is its awaitable twin."""

    run_steps = staticmethod(steps.arun)  # drives the operations of bulk and OperatorViews

    def __init__(
        self,
        url: str = DEFAULT_URL,
        queue: str = "default",
        *,
        prefix: str = DEFAULT_PREFIX,
        max_queue_depth: int | None = DEFAULT_MAX_QUEUE_DEPTH,
        max_connections: int | None = None,
        wait_replicas: int = 0,
        wait_timeout_ms: int = 1000,
        placement: bool = True,
    ):
        self.queue = check_name("queue", queue)
        self.keys = Keys(prefix)
        self.max_queue_depth = core.check_max_queue_depth(max_queue_depth)
        self.replication = Replication(wait_replicas, wait_timeout_ms)
        self.placement = Placement(placement)
        target = parse_url(url)
        self.redis = connect_async(
            target,
            decode_responses=True,
            retry=async_retry_policy(target.mode),
            max_connections=max_connections,
        )

    async def aclose(self) -> None:
        await self.redis.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        input_ids: list[int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        request_fingerprint: str | None = None,
        stream: bool = False,
        **sampling: Any,
    ) -> str:
        job = core.build_job(
            prompt,
            messages,
            input_ids,
            request_id,
            timeout_s,
            priority,
            sampling,
            request_fingerprint,
            stream=stream,
        )
        await self.run_steps(self.redis, self.placement.check_adapters(self.keys, self.queue, [job.adapter]))
        if job.idempotent:
            if not job.created((await execution.aexecute(self.redis, job.create_call(self.keys).add_to))[0]):
                return job.job_id
            added = await self._enqueue_or_forget(job, create=False)
        else:
            added = await self._enqueue_or_forget(job, create=True)
        if not added[0]:
            await self.redis.delete(self.keys.job(job.job_id))
            raise QueueFull(self.queue, added[1], self.max_queue_depth)
        return job.job_id

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        job_id = core.check_job_id(job_id)
        deadline = Deadline(job_id, core.check_timeout(timeout))
        job = await self.redis.hgetall(self.keys.job(job_id))
        if not job:
            raise JobNotFound(job_id)
        return core.finished(job_id, job["result"] if "result" in job else await self._wait_done(job_id, deadline))

    async def wait(self, job_id: str, timeout: float | None = None) -> JobResult:
        job_id = core.check_job_id(job_id)
        return core.finished(job_id, await self._wait_done(job_id, Deadline(job_id, core.check_timeout(timeout))))

    async def stream(self, job_id: str, after: str = "0-0", timeout: float | None = None) -> AsyncIterator[TokenDelta]:
        job_id = core.check_job_id(job_id)
        reader = JobStream(job_id, after)
        deadline = Deadline(job_id, core.check_timeout(timeout))
        follow = scripts.follow(self.keys, job_id)
        if not (await execution.aexecute(self.redis, follow.add_to))[0]:
            raise JobNotFound(job_id)
        while reader.end is None:
            for event_id, fields in await self._read_events(job_id, reader.last, deadline):
                for delta in reader.take(event_id, fields):
                    yield delta
                if reader.end is not None:
                    core.finished(job_id, reader.end)
                    return

    async def status(self, job_id: str) -> JobStatus:
        job_id = core.check_job_id(job_id)
        return await steps.arun(self.redis, core.read_status(self.keys, job_id))

    async def cancel(self, job_id: str) -> JobStatus:
        job_id = core.check_job_id(job_id)
        cancel = core.cancel_call(self.keys, job_id)
        if (await execution.aexecute(self.redis, cancel.add_to))[0] is None:
            raise JobNotFound(job_id)
        return await self.status(job_id)

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> JobResult:
        deadline_s = core.check_timeout(timeout)
        job_id = await self.submit(prompt, **kwargs)
        return core.finished(job_id, await self._wait_done(job_id, Deadline(job_id, deadline_s)))

    async def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> list[str]:
        operation = bulk.submit_steps(
            self.keys, self.queue, self.max_queue_depth, bulk.build_jobs(jobs), self.placement
        )
        return await self.run_steps(self.redis, operation)

    async def as_completed(self, job_ids: Iterable[str], timeout: float | None = None) -> AsyncIterator[JobResult]:
        job_ids = [core.check_job_id(job_id) for job_id in job_ids]
        deadline = Deadline("", core.check_timeout(timeout))
        await self.run_steps(self.redis, bulk.check_exist(self.keys, job_ids))
        watch = ResultWatch(self.keys, job_ids)
        while watch:
            try:
                results = await self._read_finished(watch, deadline.block_ms())
            except JobTimeout:
                raise JobTimeout(watch.first(), deadline.timeout) from None
            for result in results:
                yield result

    async def results(self, job_ids: Iterable[str], timeout: float | None = None) -> list[JobResult]:
        job_ids = list(job_ids)
        ended = {result.id: result async for result in self.as_completed(job_ids, timeout)}
        return [ended[job_id] for job_id in job_ids]

    async def finished(self, watch: ResultWatch, timeout: float | None = None) -> list[JobResult]:
        deadline = Deadline("", core.check_timeout(timeout))
        try:
            while watch:
                results = await self._read_finished(watch, deadline.block_ms())
                if results:
                    return results
        except JobTimeout:
            pass
        return []

    async def cancel_many(self, job_ids: Iterable[str]) -> None:
        job_ids = [core.check_job_id(job_id) for job_id in job_ids]
        if job_ids:
            await self._execute(bulk.cancel_commands(self.keys, job_ids))

    async def queue_stats(self) -> QueueStats:
        return await steps.arun(self.redis, core.read_queue_stats(self.keys, self.queue))

    async def workers(self) -> list[WorkerInfo]:
        return await steps.arun(self.redis, core.read_live_workers(self.keys))

    def on_queue(self, queue: str) -> AsyncClient:
        other = copy.copy(self)
        other.queue = check_name("queue", queue)
        return other

    async def _enqueue_or_forget(self, job: NewJob, create: bool) -> list:
        (stream,) = await self.run_steps(self.redis, self.placement.streams_for(self.keys, self.queue, [job.prefix]))
        add = core.enqueue_commands(
            self.keys,
            self.queue,
            self.max_queue_depth,
            job,
            create,
            self.replication,
            stream,
        )
        try:
            replies = await execution.aexecute(self.redis, add)
        except BaseException:
            await self.redis.delete(self.keys.job(job.job_id))
            raise
        return core.enqueued(job, create, self.replication, replies)

    async def _execute(self, add_commands) -> list:
        return await execution.aexecute(self.redis, add_commands)

    async def _read_finished(self, watch: ResultWatch, block_ms: int) -> list[JobResult]:
        return await self.run_steps(self.redis, bulk.read_finished(watch, block_ms, is_cluster(self.redis)))

    async def _wait_done(self, job_id: str, deadline: Deadline) -> str:
        while True:
            entries = await self._xread(self.keys.done(job_id), "0-0", 1, deadline)
            if entries:
                return entries[0][1]["data"]

    async def _read_events(self, job_id: str, after: str, deadline: Deadline) -> list:
        return await self._xread(self.keys.events(job_id), after, EVENT_BATCH, deadline)

    async def _xread(self, key: str, after: str, count: int, deadline: Deadline) -> list:
        try:
            reply = await self.redis.xread({key: after}, count=count, block=deadline.block_ms())
        except redis.ResponseError as e:
            if not core.read_cut_short(e):
                raise
            return []
        return reply[0][1] if reply else []
