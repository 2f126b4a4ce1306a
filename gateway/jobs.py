"""The jobs of one HTTP request: submitted together, watched together, and cancelled together
when the request ends before them.

Everything a request waits for arrives on one asyncio queue (its inbox): each job's token deltas
and result (or error) from a task per job, the client leaving, and the gateway stopping. So a
request never polls, and a keep-alive is just a timeout on the inbox.

When a request ends before its jobs (its client left, another choice failed, its deadline
passed), the unfinished jobs are cancelled, except:
- while the gateway stops: its successor will serve the client's retry;
- when the request carries an Idempotency-Key: the client means to retry, and the retry must
  find the same jobs running, not cancelled;
- on a disconnect, when the setting `cancel_on_disconnect` is off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.cancellation import cancel_and_wait
from gateway.errors import gateway_stopping
from gateway.lifecycle import Lifecycle
from openai_format.job_specs import JobSpec
from producer_client import AsyncClient, JobResult, TokenDelta
from producer_client.rate_limits import NO_RATE_LIMITS, RateLimits
from producer_client.sharing import Submitted

log = logging.getLogger("gateway.jobs")

LEFT = object()  # the client disconnected
Receive = Callable[[], Awaitable[dict]]


@dataclass(frozen=True)
class JobEvent:
    index: int  # the job's choice index
    item: TokenDelta | JobResult | Exception


@dataclass
class RequestJobs:
    client: AsyncClient  # on the request's queue, as its tenant
    ids: list[str]
    request_id: str
    idempotent: bool
    finished: set[int] = field(default_factory=set)  # indexes of the jobs whose result is in
    limits: RateLimits = NO_RATE_LIMITS  # the tenant's rate limits after the last job went in

    def unfinished(self) -> list[str]:
        return [job_id for i, job_id in enumerate(self.ids) if i not in self.finished]


class Jobs:
    def __init__(self, lifecycle: Lifecycle, job_timeout_s: float, cancel_on_disconnect: bool):
        self.lifecycle = lifecycle
        self.job_timeout_s = job_timeout_s
        self.cancel_on_disconnect = cancel_on_disconnect
        self.background: set[asyncio.Task] = set()  # held so that they run to their end

    async def submit(
        self,
        client: AsyncClient,
        specs: list[JobSpec],
        key: str | None,
        fingerprint: str,
        request_id: str,
        stream: bool,
        tokens: int | None = None,
        refused_after: Callable[[RequestJobs], None] | None = None,
    ) -> RequestJobs:
        """Enqueue one job per spec (see Gateway.check for their validation), as streamed jobs for
        an SSE response. With an Idempotency-Key (scoped to its tenant), job i is `<key>-<i>`,
        bound to the request's `fingerprint`: a retried request finds the same jobs, another
        request with the key is refused (IdempotencyConflict).
        The request counts one request against its tenant's requests-per-minute limit, and all of
        its jobs' tokens, as OpenAI counts a request with n choices: job 0 counts the request and
        the request's `tokens` (None: a single job's own), and goes in first, so that a request a
        limit refuses leaves nothing enqueued and counted. Were each job to count its own tokens,
        a request whose later choices did not fit would leave its first ones counted and run.
        A job refused after others went in (a full queue, a waiting quota) cancels those, and
        `refused_after` is told them before the refusal is raised: they exist, and the answer names them."""

        def submit(i: int, spec: JobSpec) -> Awaitable[Submitted]:
            return client.submit_rated(
                counts_request=i == 0,
                counts_tokens=tokens if i == 0 or tokens is None else 0,
                request_id=None if key is None else f"{key}-{i}",
                request_fingerprint=None if key is None else fingerprint,
                timeout_s=self.job_timeout_s,
                stream=stream,
                **spec.submit_kwargs(),
            )

        first = await submit(0, specs[0])
        others = await asyncio.gather(*(submit(i, spec) for i, spec in enumerate(specs) if i), return_exceptions=True)
        outcomes = [first, *others]
        submitted = [o for o in outcomes if isinstance(o, Submitted)]
        jobs = RequestJobs(client, [s.job_id for s in submitted], request_id, idempotent=key is not None)
        jobs.limits = min((s.limits for s in submitted), key=lambda x: (x.remaining_requests, x.remaining_tokens))
        error = next((o for o in outcomes if isinstance(o, BaseException)), None)
        if error is not None:
            self.release(jobs, client_left=False)
            if refused_after is not None and jobs.ids:
                refused_after(jobs)
            raise error
        return jobs

    def open_inbox(self, jobs: RequestJobs, stream: bool, receive: Receive | None) -> Inbox:
        return Inbox(self, jobs, stream, receive)

    def release(self, jobs: RequestJobs, client_left: bool) -> None:
        """The request ends now: cancel its unfinished jobs, unless they are to be kept (see above)."""
        unfinished = jobs.unfinished()
        if not unfinished or self.lifecycle.stopping.is_set() or jobs.idempotent:
            return
        if client_left and not self.cancel_on_disconnect:
            return
        self.in_background(self._cancel(jobs, unfinished, "its client left" if client_left else "its request failed"))

    def in_background(self, work: Awaitable) -> None:
        """Run `work` past the end of the request that starts it."""
        task = asyncio.ensure_future(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    async def _cancel(self, jobs: RequestJobs, job_ids: list[str], why: str) -> None:
        for job_id in job_ids:
            try:
                await jobs.client.cancel(job_id)
                log.info("request %s: job %s cancelled: %s", jobs.request_id, job_id, why)
            except Exception as e:  # a job gone already, or Redis away: nothing else to do
                log.warning("request %s: could not cancel job %s: %s", jobs.request_id, job_id, e)


class Inbox:
    """One request's queue of JobEvents, LEFT and Lifecycle.STOP; close() stops its tasks."""

    def __init__(self, owner: Jobs, jobs: RequestJobs, stream: bool, receive: Receive | None):
        self.owner = owner
        self.jobs = jobs
        self.queue: asyncio.Queue = asyncio.Queue()
        watch = self._stream if stream else self._result
        self.tasks = [asyncio.ensure_future(watch(i, job_id)) for i, job_id in enumerate(jobs.ids)]
        if receive is not None:
            self.tasks.append(asyncio.ensure_future(self._watch_disconnect(receive)))
        owner.lifecycle.inboxes.add(self.queue)
        if owner.lifecycle.stopping.is_set():
            self.queue.put_nowait(Lifecycle.STOP)

    async def next(self, timeout: float | None = None):
        """The next item, or None after `timeout` seconds without one."""
        if not self.queue.empty():
            return self.queue.get_nowait()
        try:
            return await asyncio.wait_for(self.queue.get(), timeout)
        except asyncio.TimeoutError:
            return None

    def got_result(self, event: JobEvent) -> None:
        self.jobs.finished.add(event.index)

    def close(self, client_left: bool) -> None:
        self.owner.lifecycle.inboxes.discard(self.queue)
        self.owner.in_background(cancel_and_wait(self.tasks))
        self.owner.release(self.jobs, client_left)

    async def _stream(self, index: int, job_id: str) -> None:
        client = self.jobs.client
        try:
            async for delta in client.stream(job_id, timeout=self.owner.job_timeout_s):
                self.queue.put_nowait(JobEvent(index, delta))
            self.queue.put_nowait(JobEvent(index, await client.result(job_id)))
        except Exception as e:
            self.queue.put_nowait(JobEvent(index, e))

    async def _result(self, index: int, job_id: str) -> None:
        try:
            self.queue.put_nowait(
                JobEvent(index, await self.jobs.client.wait(job_id, timeout=self.owner.job_timeout_s))
            )
        except Exception as e:
            self.queue.put_nowait(JobEvent(index, e))

    async def _watch_disconnect(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.queue.put_nowait(LEFT)


async def collect(inbox: Inbox) -> list[JobResult] | None:
    """Every job's result, in choice order; None if the client left first. Raises a job's error,
    or a 503 when the gateway begins to stop."""
    results: list[JobResult | None] = [None] * len(inbox.jobs.ids)
    client_left = False
    try:
        while len(inbox.jobs.finished) < len(results):
            item = await inbox.next()
            if item is LEFT:
                client_left = True
                return None
            if item is Lifecycle.STOP:
                raise gateway_stopping()
            if isinstance(item.item, Exception):
                raise item.item
            inbox.got_result(item)
            results[item.index] = item.item
        return results
    finally:
        inbox.close(client_left)
