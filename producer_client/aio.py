"""The asyncio client: `Client`'s methods as coroutines, over redis.asyncio, in any of the three
modes (producer_client.connection). It runs the same steps as `Client` (producer_client.steps)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from producer_client import bulk, operations, steps
from producer_client.bulk import ResultWatch
from producer_client.client_base import ClientBase
from producer_client.cluster import AsyncRedis, is_cluster
from producer_client.connection import RedisURL, async_retry_policy, connect_async
from producer_client.event_feed import AsyncSubscriber
from producer_client.job_stream import follow
from producer_client.new_job import asks_for_grammar, build_job, build_job_of, builds_long
from producer_client.protocol.script import Script
from producer_client.quotas import current_rate_limits
from producer_client.rate_limits import RateLimits
from producer_client.schema import JobResult, JobStatus, QueueStats, TokenDelta, WorkerInfo
from producer_client.sharing import Submitted
from producer_client.status_reads import of_job, read_live_workers, read_queue_stats
from producer_client.steps import Steps, T
from producer_client.validation import check_job_id

B = TypeVar("B")


# Long jobs are built under the GIL (their validation is pydantic's and Python's): two threads
# building them would not finish sooner, only take the GIL from the event loop's thread more
# often. A gateway's 128 choices of one long prompt, built on the default executor's threads,
# held its /health up to 9.5 s; one at a time on this thread, 0.3-0.5 s (bench/RESULTS.md).
BUILDER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mili-builder")


async def validated(build: Callable[..., B], *args: Any, grammar: bool, long: bool = False) -> B:
    """build(*args): a job's validation, on a thread where it compiles a `grammar` or is `long`
    (builds_long). The grammar library takes up to seconds of CPU for a large schema (60,000 enum
    values: about 0.5 s), in which it lets the GIL go; a job of many messages takes up to 130 ms
    (33,000 of them), in pieces between which the interpreter hands the GIL to the loop's thread.
    On the caller's event loop either held every other coroutine of the program. Other jobs are
    validated in place: a thread's hop would cost more than their check."""
    if grammar:
        return await asyncio.to_thread(build, *args)
    if long:
        return await built_apart(build, *args)
    return build(*args)


async def built_apart(function: Callable[..., B], *args: Any) -> B:
    """function(*args) on BUILDER, the thread of work that holds the GIL: long jobs' builds, and
    the gateway's parse of long bodies."""
    return await asyncio.get_running_loop().run_in_executor(BUILDER, functools.partial(function, *args))


class AsyncClient(ClientBase):
    """See `producer_client.Client`; every method here is its awaitable twin."""

    redis: AsyncRedis
    run_steps = staticmethod(steps.arun)  # for the operator's views (ClientBase); its own calls name steps.arun

    def _connect(self, target: RedisURL, max_connections: int | None) -> AsyncRedis:
        retry = async_retry_policy(target.mode)
        redis = connect_async(target, decode_responses=True, retry=retry, max_connections=max_connections)
        self.subscriber = AsyncSubscriber(redis, self.keys)  # shared by its copies, as the pool
        return redis

    async def aclose(self) -> None:
        await self.subscriber.aclose()
        await self.redis.aclose()

    async def run_protocol(self, operation: Steps[T], scripts: Sequence[Script] = ()) -> T:
        """Runs one of producer_client.protocol's operations over this client's connection pool,
        loading `scripts` where a server lacks them: how a part built over the client (the
        gateway's batch store) sends its own commands where the jobs go."""
        return await steps.arun(self.redis, operation, scripts)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        request_id: str | None = None,
        timeout_s: float | None = None,
        priority: int = 0,
        request_fingerprint: str | None = None,
        stream: bool = False,
        service_tier: str | None = None,
        **sampling: Any,
    ) -> str:
        job = await validated(
            build_job,
            prompt,
            messages,
            input_ids,
            request_id,
            timeout_s,
            priority,
            sampling,
            request_fingerprint,
            stream,
            service_tier,
            self.known_params,
            self.tenant,
            grammar=asks_for_grammar(sampling),
            long=builds_long({"messages": messages, "input_ids": input_ids}),
        )
        return await steps.arun(self.redis, operations.submit(self, job))

    async def submit_rated(
        self, counts_request: bool = True, counts_tokens: int | None = None, **arguments: Any
    ) -> Submitted:
        job = await validated(
            build_job_of,
            arguments,
            int(counts_request),
            self.known_params,
            self.tenant,
            counts_tokens,
            grammar=asks_for_grammar(arguments),
            long=builds_long(arguments),
        )
        return await steps.arun(self.redis, operations.submit_rated(self, job))

    async def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        return await steps.arun(self.redis, of_job(job_id, operations.result(self.keys, job_id, timeout)))

    async def wait(self, job_id: str, timeout: float | None = None) -> JobResult:
        return await steps.arun(
            self.redis,
            of_job(job_id, operations.wait(self.keys, job_id, timeout, self.submissions.known(check_job_id(job_id)))),
        )

    async def stream(self, job_id: str, after: str = "0-0", timeout: float | None = None) -> AsyncIterator[TokenDelta]:
        reader, deadline = await steps.arun(self.redis, of_job(job_id, follow(self.keys, job_id, after, timeout)))
        async with self.subscriber.follow(job_id) as feed:
            while reader.end is None:
                if reader.reads_feed(feed):
                    await feed.wait(reader.wait_s(deadline))
                    read = reader.read_feed(self.keys, deadline, feed)
                else:
                    read = reader.read(self.keys, deadline)
                for delta in await steps.arun(self.redis, of_job(job_id, read)):
                    yield delta
        reader.result()

    async def status(self, job_id: str) -> JobStatus:
        return await steps.arun(self.redis, of_job(job_id, operations.status(self.keys, job_id)))

    async def cancel(self, job_id: str) -> JobStatus:
        return await steps.arun(self.redis, of_job(job_id, operations.cancel(self.keys, job_id)))

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> JobResult:
        arguments = {"prompt": prompt, **kwargs}
        job = await validated(
            build_job_of,
            arguments,
            1,
            self.known_params,
            self.tenant,
            grammar=asks_for_grammar(arguments),
            long=builds_long(arguments),
        )
        return await steps.arun(self.redis, operations.generate(self, job, timeout))

    async def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> list[str]:
        specs = bulk.listed_specs(jobs)
        grammar = any(isinstance(spec, Mapping) and asks_for_grammar(spec) for spec in specs)
        long = any(isinstance(spec, Mapping) and builds_long(spec) for spec in specs)
        built = await validated(bulk.build_jobs, specs, self.tenant, grammar=grammar, long=long)
        return await steps.arun(self.redis, bulk.submit_built(self, built))

    async def as_completed(self, job_ids: Iterable[str], timeout: float | None = None) -> AsyncIterator[JobResult]:
        watch, deadline = await steps.arun(self.redis, bulk.watch_all(self.keys, job_ids, timeout))
        while watch:
            for result in await steps.arun(self.redis, bulk.next_finished(watch, deadline, is_cluster(self.redis))):
                yield result

    async def results(self, job_ids: Iterable[str], timeout: float | None = None) -> list[JobResult]:
        return await steps.arun(self.redis, bulk.results(self.keys, job_ids, timeout, is_cluster(self.redis)))

    def watch(self, job_ids: Iterable[str] = ()) -> ResultWatch:
        """A ResultWatch of `job_ids` over this client's keys, for finished() (Client.watch)."""
        return ResultWatch(self.keys, job_ids)

    async def finished(self, watch: ResultWatch, timeout: float | None = None) -> list[JobResult]:
        return await steps.arun(self.redis, bulk.take_finished(watch, timeout, is_cluster(self.redis)))

    async def cancel_many(self, job_ids: Iterable[str]) -> None:
        await steps.arun(self.redis, bulk.cancel_many(self.keys, job_ids))

    async def rate_limits(self) -> RateLimits:
        return await steps.arun(self.redis, current_rate_limits(self.keys, self.queue, self.tenant, self.quota_cache))

    async def queue_stats(self) -> QueueStats:
        return await steps.arun(self.redis, read_queue_stats(self.keys, self.queue))

    async def workers(self) -> list[WorkerInfo]:
        return await steps.arun(self.redis, read_live_workers(self.keys))
