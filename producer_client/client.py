"""The synchronous client, of one Redis server, a Sentinel-managed master or a Redis Cluster
(producer_client.connection: their URLs carry AUTH and TLS). Every argument, the URL too, is
validated before the first command is sent."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import redis

from producer_client import bulk, core, steps
from producer_client.bulk import ResultWatch
from producer_client.cluster import is_cluster
from producer_client.connection import connect, parse_url, retry_policy
from producer_client.core import DEFAULT_MAX_QUEUE_DEPTH, DEFAULT_URL, EVENT_BATCH, Deadline, NewJob, Replication
from producer_client.errors import JobNotFound, JobTimeout, QueueFull
from producer_client.job_stream import JobStream
from producer_client.keys import DEFAULT_PREFIX, Keys, check_name
from producer_client.operator_views import OperatorViews
from producer_client.placement import Placement
from producer_client.protocol import execution
from producer_client.protocol import producer as scripts
from producer_client.schema import JobResult, JobStatus, QueueStats, TokenDelta, WorkerInfo


class Client(OperatorViews):
    """Submit jobs to a MILI queue and read their results.

    `max_queue_depth` is the backpressure bound: `submit` raises QueueFull when the queue
    already holds that many unacknowledged entries (None: no bound). The check and the
    XADD are one script, so the bound holds whatever the number of producers; entries are
    never trimmed to enforce it. `max_connections` bounds the connection pool (None: redis-py's
    default, 100; on a cluster, per node); every call in flight holds a connection, a blocking read
    for as long as it waits. `wait_replicas` (0: off) makes `submit` return only once that many
    replicas have the job and its entry (WAIT, for at most `wait_timeout_ms`), else raise
    NotReplicated: then a failover cannot lose an acknowledged submit. `placement` (on by
    default) sends a job to the worker likely to hold its prompt's prefix in its cache, when more
    than one worker serves the queue and advertises it (docs/architecture.md); off, every job goes
    to the shared stream.
    """

    run_steps = staticmethod(steps.run)  # drives the operations of bulk and OperatorViews

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
        self.redis = connect(
            target,
            decode_responses=True,
            retry=retry_policy(target.mode),
            max_connections=max_connections,
        )

    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(
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
        """Enqueue a job and return its id. `sampling` takes SamplingParams' fields (max_tokens,
        temperature, top_p, ...) and `adapter`, the LoRA adapter to run with (UnknownAdapter,
        before anything is enqueued, for one no live worker of the queue serves). A `request_id` seen before enqueues nothing and returns the same
        id, if it came with the same request (prompt, sampling parameters and chat options; or
        `request_fingerprint`, a digest of a request of the caller's own such as an HTTP body,
        when given); with another it raises IdempotencyConflict and enqueues nothing. `stream`:
        its tokens will be read as they come (stream()), so the worker publishes them within its
        stream_interval_s from the first; without it, a reader's stream() gets them at the
        worker's checkpoint_interval_s until the worker sees the reader."""
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
        self.run_steps(self.redis, self.placement.check_adapters(self.keys, self.queue, [job.adapter]))
        if job.idempotent:
            if not job.created(execution.execute(self.redis, job.create_call(self.keys).add_to)[0]):
                return job.job_id
            added = self._enqueue_or_forget(job, create=False)
        else:
            # A fresh id cannot collide: create the job and enqueue it in one round trip.
            added = self._enqueue_or_forget(job, create=True)
        if not added[0]:
            self.redis.delete(self.keys.job(job.job_id))
            raise QueueFull(self.queue, added[1], self.max_queue_depth)
        return job.job_id

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Block until the job ends (XREAD BLOCK on its `done` stream; no polling) and return its
        result. Raises JobFailed for a failed job, JobTimeout, JobNotFound."""
        job_id = core.check_job_id(job_id)
        deadline = Deadline(job_id, core.check_timeout(timeout))
        job = self.redis.hgetall(self.keys.job(job_id))
        if not job:
            raise JobNotFound(job_id)
        return core.finished(job_id, job["result"] if "result" in job else self._wait_done(job_id, deadline))

    def wait(self, job_id: str, timeout: float | None = None) -> JobResult:
        """result() of a job known to exist (this client just submitted it): one blocking read of
        its `done` stream, without looking the job up first."""
        job_id = core.check_job_id(job_id)
        return core.finished(job_id, self._wait_done(job_id, Deadline(job_id, core.check_timeout(timeout))))

    def stream(self, job_id: str, after: str = "0-0", timeout: float | None = None) -> Iterator[TokenDelta]:
        """Yield the job's token deltas until it ends. Resume after a disconnect with
        `after=` the last delta's `event_id`: nothing is lost or repeated. A chat's deltas carry
        its answer (`text`), reasoning and tool calls apart. A failed job raises JobFailed at its end.
        The job counts as streamed from now on (FOLLOW): its worker publishes its tokens within
        stream_interval_s once it sees that."""
        job_id = core.check_job_id(job_id)
        reader = JobStream(job_id, after)
        deadline = Deadline(job_id, core.check_timeout(timeout))
        follow = scripts.follow(self.keys, job_id)
        if not execution.execute(self.redis, follow.add_to)[0]:
            raise JobNotFound(job_id)
        while reader.end is None:
            for event_id, fields in self._read_events(job_id, reader.last, deadline):
                yield from reader.take(event_id, fields)
                if reader.end is not None:
                    core.finished(job_id, reader.end)
                    return

    def status(self, job_id: str) -> JobStatus:
        job_id = core.check_job_id(job_id)
        return steps.run(self.redis, core.read_status(self.keys, job_id))

    def cancel(self, job_id: str) -> JobStatus:
        """A queued job is cancelled at once; a running one stops within its worker's
        stream_interval_s if streamed, else its checkpoint_interval_s (plus a step), and
        keeps its partial output. Returns the status right after the request."""
        job_id = core.check_job_id(job_id)
        cancel = core.cancel_call(self.keys, job_id)
        if execution.execute(self.redis, cancel.add_to)[0] is None:
            raise JobNotFound(job_id)
        return self.status(job_id)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> JobResult:
        """submit() then result(), without looking the job up: it was just created."""
        deadline_s = core.check_timeout(timeout)
        job_id = self.submit(prompt, **kwargs)
        return core.finished(job_id, self._wait_done(job_id, Deadline(job_id, deadline_s)))

    def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> list[str]:
        """Enqueue many jobs, each a dict of submit()'s keyword arguments (`request_id` too), and
        return their ids in order. Every spec is validated before anything is sent (InvalidArgument
        names `jobs[<index>].<field>`); the jobs go out in pipelined chunks. The queue's bound holds
        as for submit(): a queue that fills part-way raises BulkQueueFull (a QueueFull), whose
        `job_ids` are those of the specs enqueued, a prefix of them; no spec after them was."""
        operation = bulk.submit_steps(
            self.keys, self.queue, self.max_queue_depth, bulk.build_jobs(jobs), self.placement
        )
        return self.run_steps(self.redis, operation)

    def as_completed(self, job_ids: Iterable[str], timeout: float | None = None) -> Iterator[JobResult]:
        """Yield the jobs' results as they end, in the order they end, a round trip per batch of
        them (see ResultWatch). A failed job's result is yielded (status `failed`, with its error),
        not raised. Raises JobNotFound for an id with no job before yielding anything, and
        JobTimeout, naming an unfinished job, once `timeout` seconds have passed."""
        job_ids = [core.check_job_id(job_id) for job_id in job_ids]
        deadline = Deadline("", core.check_timeout(timeout))
        self.run_steps(self.redis, bulk.check_exist(self.keys, job_ids))
        watch = ResultWatch(self.keys, job_ids)
        while watch:
            try:
                yield from self._read_finished(watch, deadline.block_ms())
            except JobTimeout:
                raise JobTimeout(watch.first(), deadline.timeout) from None

    def results(self, job_ids: Iterable[str], timeout: float | None = None) -> list[JobResult]:
        """Every job's result, in the order of `job_ids`, collected as as_completed() does."""
        job_ids = list(job_ids)
        ended = {result.id: result for result in self.as_completed(job_ids, timeout)}
        return [ended[job_id] for job_id in job_ids]

    def finished(self, watch: ResultWatch, timeout: float | None = None) -> list[JobResult]:
        """The results of the watched jobs that have ended, taken out of `watch`: at once if any
        has, else as soon as one does; [] if none has within `timeout` seconds. For callers that
        add jobs as they go (ResultWatch.add); as_completed() is this over a fixed set."""
        deadline = Deadline("", core.check_timeout(timeout))
        try:
            while watch:
                results = self._read_finished(watch, deadline.block_ms())
                if results:
                    return results
        except JobTimeout:
            pass
        return []

    def cancel_many(self, job_ids: Iterable[str]) -> None:
        """cancel() of each job in one round trip; an id with no job is passed over."""
        job_ids = [core.check_job_id(job_id) for job_id in job_ids]
        if job_ids:
            self._execute(bulk.cancel_commands(self.keys, job_ids))

    def queue_stats(self) -> QueueStats:
        return steps.run(self.redis, core.read_queue_stats(self.keys, self.queue))

    def workers(self) -> list[WorkerInfo]:
        """Every live worker of every queue, from the queue index, each queue's worker index and
        the heartbeats (an expired heartbeat is a dead worker): which models are served where."""
        return steps.run(self.redis, core.read_live_workers(self.keys))

    def on_queue(self, queue: str) -> Client:
        """A client of `queue` with this one's settings, over the same connection pool: one pool
        serves every queue (closing either client closes it)."""
        other = copy.copy(self)
        other.queue = check_name("queue", queue)
        return other

    def _enqueue_or_forget(self, job: NewJob, create: bool) -> list:
        """ENQUEUE's reply. If the enqueue fails, the job hash goes, so that a later submit with
        the same request_id enqueues the job instead of finding one that will never run, and no
        hash of a job that was never taken stays behind. An enqueued job too few replicas
        confirmed stays: it runs (NotReplicated)."""
        (stream,) = self.run_steps(self.redis, self.placement.streams_for(self.keys, self.queue, [job.prefix]))
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
            replies = execution.execute(self.redis, add)
        except BaseException:
            self.redis.delete(self.keys.job(job.job_id))
            raise
        return core.enqueued(job, create, self.replication, replies)

    def _execute(self, add_commands) -> list:
        return execution.execute(self.redis, add_commands)

    def _read_finished(self, watch: ResultWatch, block_ms: int) -> list[JobResult]:
        """The window's jobs that have ended, or [] if none did within `block_ms` (bulk.read_finished)."""
        return self.run_steps(self.redis, bulk.read_finished(watch, block_ms, is_cluster(self.redis)))

    def _wait_done(self, job_id: str, deadline: Deadline) -> str:
        """The job's result JSON, from its `done` stream: there at once if the job has ended."""
        while True:
            entries = self._xread(self.keys.done(job_id), "0-0", 1, deadline)
            if entries:
                return entries[0][1]["data"]

    def _read_events(self, job_id: str, after: str, deadline: Deadline) -> list:
        """Events after `after`; none if a blocking read of at most MAX_BLOCK_MS saw none."""
        return self._xread(self.keys.events(job_id), after, EVENT_BATCH, deadline)

    def _xread(self, key: str, after: str, count: int, deadline: Deadline) -> list:
        """One blocking XREAD of one stream: its entries after `after`. A read that Redis cut
        short (the server changed role in a failover) returns none, and the caller reads again."""
        try:
            reply = self.redis.xread({key: after}, count=count, block=deadline.block_ms())
        except redis.ResponseError as e:
            if not core.read_cut_short(e):
                raise
            return []
        return reply[0][1] if reply else []
