"""The synchronous client, of one Redis server, a Sentinel-managed master or a Redis Cluster
(producer_client.connection: their URLs carry AUTH and TLS). Every argument, the URL too, is
validated before the first command is sent. Each operation is written once, as steps
(producer_client.operations, bulk, job_stream), and run here over redis-py."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from producer_client import bulk, operations, steps
from producer_client.bulk import ResultWatch
from producer_client.client_base import ClientBase
from producer_client.cluster import SyncRedis, is_cluster
from producer_client.connection import RedisURL, connect, retry_policy
from producer_client.event_feed import Subscriber
from producer_client.job_stream import follow
from producer_client.new_job import build_job, build_job_of
from producer_client.quotas import current_rate_limits
from producer_client.rate_limits import RateLimits
from producer_client.schema import JobResult, JobStatus, QueueStats, TokenDelta, WorkerInfo
from producer_client.sharing import Submitted
from producer_client.status_reads import of_job, read_live_workers, read_queue_stats
from producer_client.validation import check_job_id


class Client(ClientBase):
    """Submit jobs to a MILI queue and read their results.

    `max_queue_depth` is the backpressure bound of each of the queue's streams (one per lane and
    tenant): `submit` raises QueueFull when the job's stream already holds that many
    unacknowledged entries (None: no bound), so one tenant's backlog never refuses another's
    submit. The check and the XADD are one script, so the bound holds whatever the number of
    producers; entries are never trimmed to enforce it. `max_connections` bounds the connection pool (None: redis-py's
    default, 100; on a cluster, per node); every call in flight holds a connection, a blocking read
    for as long as it waits. `tenant` names who submits (None: nobody in particular): a tenant's
    jobs get a fair share of each lane's tokens against other tenants', and its quotas and rate
    limits (`mili quota set`) hold. `wait_replicas` (0: off) makes `submit` return only once that many
    replicas have the job and its entry (WAIT, for at most `wait_timeout_ms`), else raise
    NotReplicated: then a failover cannot lose an acknowledged submit. `placement` (on by
    default) sends a job to the worker likely to hold its prompt's prefix in its cache, when more
    than one worker serves the queue and advertises it (docs/architecture.md); off, every job goes
    to the shared stream. `queue_shards` spreads the jobs over a queue spread over that many shards
    (ShardCountMismatch if the queue has another count), or with "auto" over each queue's own
    count; 1 (the default) sends them to shard 0, which every worker reads (docs/architecture.md,
    "A queue over several shards").
    """

    redis: SyncRedis
    run_steps = staticmethod(steps.run)  # for the operator's views (ClientBase); its own calls name steps.run

    def _connect(self, target: RedisURL, max_connections: int | None) -> SyncRedis:
        redis = connect(target, decode_responses=True, retry=retry_policy(target.mode), max_connections=max_connections)
        self.subscriber = Subscriber(redis, self.keys)  # shared by its copies, as the pool
        return redis

    def close(self) -> None:
        self.subscriber.close()
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def submit(
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
        """Enqueue a job and return its id. `sampling` takes SamplingParams' fields (max_tokens,
        temperature, top_p, ...) and `adapter`, the LoRA adapter to run with (UnknownAdapter,
        before anything is enqueued, for one no live worker of the queue serves). A `request_id`
        seen before enqueues nothing and returns the same id, if it came with the same request
        (prompt, sampling parameters and chat options; or `request_fingerprint`, a digest of a
        request of the caller's own such as an HTTP body, when given); with another it raises IdempotencyConflict and enqueues nothing. `stream`:
        its tokens will be read as they come (stream()), so the worker publishes them within its
        stream_interval_s from the first; without it, a reader's stream() gets them at the
        worker's checkpoint_interval_s until the worker sees the reader. `service_tier` (OpenAI's
        values: "priority", "default" or "auto", "flex") is the job's lane: a worker with room takes
        the highest lane's jobs first (docs/client.md). Over the client's tenant's limits it raises
        RateLimited, or WaitingQuotaExceeded (a QueueFull)."""
        job = build_job(
            prompt,
            messages,
            input_ids,
            request_id,
            timeout_s,
            priority,
            sampling,
            request_fingerprint,
            stream=stream,
            service_tier=service_tier,
            known_params=self.known_params,
            tenant=self.tenant,
        )
        return steps.run(self.redis, operations.submit(self, job))

    def submit_rated(
        self, counts_request: bool = True, counts_tokens: int | None = None, **arguments: Any
    ) -> Submitted:
        """submit() of `arguments`, returning the job's id with its tenant's rate limits after it
        (the gateway's x-ratelimit-* headers). `counts_request` False: the job is a further choice
        of a request another job counted, so it counts no request against the tenant's
        requests-per-minute limit (OpenAI counts a request with n choices as one). `counts_tokens`:
        the tokens it counts against the tokens-per-minute limit in place of its own (None): a
        request's first job counts every choice's and the further ones 0, so that a request whose
        choices do not fit together is refused whole, nothing enqueued."""
        job = build_job_of(arguments, int(counts_request), self.known_params, self.tenant, counts_tokens)
        return steps.run(self.redis, operations.submit_rated(self, job))

    def result(self, job_id: str, timeout: float | None = None) -> JobResult:
        """Block until the job ends (XREAD BLOCK on its `done` stream; no polling) and return its
        result. Raises JobFailed for a failed job, JobTimeout, JobNotFound; InvalidJob, as every
        call on one job does, where a key of the job holds another type (status_reads.of_job)."""
        return steps.run(self.redis, of_job(job_id, operations.result(self.keys, job_id, timeout)))

    def wait(self, job_id: str, timeout: float | None = None) -> JobResult:
        """result() of a job known to exist (this client just submitted it): one blocking read of
        its `done` stream, without looking the job up first. A job this client did not submit with
        a fresh id in the last DONE_TTL_MS / 2 (a request_id's, one submitted elsewhere, or an older
        one) is looked at once first: for its deadline, and for a result its `done` stream no
        longer holds."""
        return steps.run(
            self.redis,
            of_job(job_id, operations.wait(self.keys, job_id, timeout, self.submissions.known(check_job_id(job_id)))),
        )

    def stream(self, job_id: str, after: str = "0-0", timeout: float | None = None) -> Iterator[TokenDelta]:
        """Yield the job's token deltas until it ends. Resume after a disconnect with
        `after=` the last delta's `event_id`: nothing is lost or repeated. `after` takes every
        stream id XREAD reads, meaning what it means there: `ms-seq`, `ms` alone (`ms-0`), `0` (from
        the start), and `$` (only the events after the stream opens). A chat's deltas carry
        its answer (`text`), reasoning and tool calls apart. A failed job raises JobFailed at its end.
        The job counts as streamed from now on (FOLLOW): its worker publishes its tokens within
        stream_interval_s once it sees that. A job that had ended unfollowed (and kept no events)
        gives its whole output as one delta."""
        reader, deadline = steps.run(self.redis, of_job(job_id, follow(self.keys, job_id, after, timeout)))
        with self.subscriber.follow(job_id) as feed:
            while reader.end is None:
                if reader.reads_feed(feed):
                    feed.wait(reader.wait_s(deadline))
                    read = reader.read_feed(self.keys, deadline, feed)
                else:
                    read = reader.read(self.keys, deadline)
                yield from steps.run(self.redis, of_job(job_id, read))
        reader.result()

    def status(self, job_id: str) -> JobStatus:
        return steps.run(self.redis, of_job(job_id, operations.status(self.keys, job_id)))

    def cancel(self, job_id: str) -> JobStatus:
        """A queued job is cancelled at once; a running one stops within its worker's
        stream_interval_s if streamed, else its checkpoint_interval_s (plus a step), and
        keeps its partial output. Returns the status right after the request."""
        return steps.run(self.redis, of_job(job_id, operations.cancel(self.keys, job_id)))

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs: Any) -> JobResult:
        """submit() then result(), without looking the job up: it was just created."""
        job = build_job_of({"prompt": prompt, **kwargs}, known_params=self.known_params, tenant=self.tenant)
        return steps.run(self.redis, operations.generate(self, job, timeout))

    def submit_many(self, jobs: Iterable[Mapping[str, Any]]) -> list[str]:
        """Enqueue many jobs, each a dict of submit()'s keyword arguments (`request_id` too), and
        return their ids in order. Every spec is validated before anything is sent (InvalidArgument
        names `jobs[<index>].<field>`); the jobs go out in pipelined chunks. The queue's bound holds
        as for submit(): a queue that fills part-way raises BulkQueueFull (a QueueFull), whose
        `job_ids` are those of the specs enqueued, a prefix of them; no spec after them was."""
        return steps.run(self.redis, bulk.submit_many(self, jobs))

    def as_completed(self, job_ids: Iterable[str], timeout: float | None = None) -> Iterator[JobResult]:
        """Yield the jobs' results as they end, in the order they end, a round trip per batch of
        them (see ResultWatch). A failed job's result is yielded (status `failed`, with its error),
        not raised; so is a job one of whose keys holds another type (InvalidJob's `invalid_job`). Raises JobNotFound for an id with no job before yielding anything, and
        JobTimeout, naming an unfinished job, once `timeout` seconds have passed."""
        watch, deadline = steps.run(self.redis, bulk.watch_all(self.keys, job_ids, timeout))
        while watch:
            yield from steps.run(self.redis, bulk.next_finished(watch, deadline, is_cluster(self.redis)))

    def results(self, job_ids: Iterable[str], timeout: float | None = None) -> list[JobResult]:
        """Every job's result, in the order of `job_ids`, collected as as_completed() does."""
        return steps.run(self.redis, bulk.results(self.keys, job_ids, timeout, is_cluster(self.redis)))

    def watch(self, job_ids: Iterable[str] = ()) -> ResultWatch:
        """A ResultWatch of `job_ids` over this client's keys (its prefix), for finished(): add jobs
        to it as they go (watch.add)."""
        return ResultWatch(self.keys, job_ids)

    def finished(self, watch: ResultWatch, timeout: float | None = None) -> list[JobResult]:
        """The results of the watched jobs that have ended, taken out of `watch`: at once if any
        has, else as soon as one does; [] if none has within `timeout` seconds. For callers that
        add jobs as they go (ResultWatch.add); as_completed() is this over a fixed set."""
        return steps.run(self.redis, bulk.take_finished(watch, timeout, is_cluster(self.redis)))

    def cancel_many(self, job_ids: Iterable[str]) -> None:
        """cancel() of each job in one round trip; an id with no job is passed over. InvalidJob
        names a job one of whose keys holds another type, once the others are cancelled."""
        steps.run(self.redis, bulk.cancel_many(self.keys, job_ids))

    def rate_limits(self) -> RateLimits:
        """The client's tenant's rate limits on its queue now (counting nothing): what the
        gateway's x-ratelimit-* headers say of an answer that enqueued no job."""
        return steps.run(self.redis, current_rate_limits(self.keys, self.queue, self.tenant, self.quota_cache))

    def queue_stats(self) -> QueueStats:
        return steps.run(self.redis, read_queue_stats(self.keys, self.queue))

    def workers(self) -> list[WorkerInfo]:
        """Every live worker of every queue, from the queue index, each queue's worker index and
        the heartbeats (an expired heartbeat is a dead worker): which models are served where."""
        return steps.run(self.redis, read_live_workers(self.keys))
