"""How a job enters the queue under its sharing rules (docs/architecture.md, "Sharing rules"): the
call that enqueues it (the queue's own stream for the default lane's jobs of no tenant, as
before lanes; a lane's stream of its tenant, through ENQUEUE_LANES with the tenant's limits; a
worker's own stream, when placement chose one), and what each refusal raises."""

from __future__ import annotations

from dataclasses import dataclass

from producer_client.connection import is_other_type
from producer_client.errors import (
    InvalidArgument,
    InvalidQueueStream,
    MiliError,
    QueueFull,
    RateLimited,
    WaitingQuotaExceeded,
)
from producer_client.keys import DEFAULT_LANE, NO_TENANT, Keys
from producer_client.new_job import NewJob
from producer_client.protocol import producer as scripts
from producer_client.protocol.producer import LaneJob, Limits, PlacedEntry
from producer_client.protocol.replies import Enqueued, Refusal
from producer_client.protocol.script import ScriptCall
from producer_client.rate_limits import NO_RATE_LIMITS, RateLimits


@dataclass(frozen=True)
class Submitted:
    """A submit's outcome: the job's id, and its tenant's rate limits after it (for the gateway's
    x-ratelimit-* headers; all 0 for a tenant without limits)."""

    job_id: str
    limits: RateLimits = NO_RATE_LIMITS


def lane_job(job: NewJob) -> LaneJob:
    return LaneJob(job.lane, job.cost, job.job_id, job.body, job.requests, job.tokens)


def uses_queue_stream(jobs: list[NewJob], tenant: str) -> bool:
    """Whether every job goes to the queue's own stream: the default lane's, of no tenant."""
    return tenant == NO_TENANT and all(job.lane == DEFAULT_LANE for job in jobs)


def goes_to_queue_stream(job: NewJob, tenant: str) -> bool:
    """uses_queue_stream of one job, without its generator's calls (a submit's)."""
    return tenant == NO_TENANT and job.lane == DEFAULT_LANE


def refuse_queue_stream_of_another_type(reply: object, queue: str, jobs: list[NewJob], tenant: str) -> None:
    """Raises InvalidQueueStream where `reply`, the enqueue's of `jobs` to the queue's own stream
    (ENQUEUE, ENQUEUE_MANY: they touch that stream alone), is WRONGTYPE: a producer made it another
    type, and its jobs went with the DEL that did, so no script makes it anew (the workers log it
    and retry until an operator deletes it). A lane's stream is refused by ENQUEUE_LANES itself."""
    if is_other_type(reply) and uses_queue_stream(jobs, tenant):
        raise InvalidQueueStream(queue, DEFAULT_LANE, NO_TENANT)


def enqueue_call(
    keys: Keys, queue: str, tenant: str, job: NewJob, max_depth: int | None, limits: Limits, stream: str | None
) -> ScriptCall | PlacedEntry:
    """The call that adds `job`: to the worker stream `stream` placement chose (no bound of its
    own: placement puts a job there only while the worker has a free slot; its route rides in its
    fields), to the queue's own stream, or to its lane's stream of `tenant`."""
    if stream is not None:
        return PlacedEntry(stream, job.job_id, job.body, placed_fields(job, tenant))
    if goes_to_queue_stream(job, tenant):
        return scripts.enqueue(keys.queue(queue), max_depth or 0, job.job_id, job.body)
    return scripts.enqueue_lanes(keys, queue, tenant, [lane_job(job)], max_depth or 0, limits)


def reserve_call(keys: Keys, queue: str, tenant: str, jobs: list[NewJob], limits: Limits) -> ScriptCall:
    """ENQUEUE_LANES checking and counting `jobs` against `tenant`'s limits, adding nothing: they
    go to a worker's own stream, on another shard of a cluster."""
    return scripts.enqueue_lanes(keys, queue, tenant, [lane_job(job) for job in jobs], 0, limits, reserve=True)


def placed_fields(job: NewJob, tenant: str) -> dict[str, str]:
    """A placed entry's route and cost: only lane-aware workers take placed jobs."""
    fields = {"cost": str(job.cost)}
    if job.lane != DEFAULT_LANE:
        fields["lane"] = job.lane
    if tenant != NO_TENANT:
        fields["tenant"] = tenant
    return fields


def refusal_error(
    outcome: Enqueued, queue: str, tenant: str, max_depth: int | None, job_ids: list[str] | None = None
) -> MiliError | None:
    """The error an enqueue's refusal raises; None when nothing was refused. `job_ids`: from
    submit_many, the ids of the specs enqueued (BulkQueueFull's are made by the caller)."""
    if outcome.refusal is Refusal.NONE:  # nearly every enqueue: none of the refusals' checks
        return None
    first, second = (outcome.values + (0, ""))[:2]
    if outcome.refusal is Refusal.FULL:
        return QueueFull(queue, int(first), max_depth or 0)
    if outcome.refusal is Refusal.QUOTA:
        return WaitingQuotaExceeded(queue, tenant, int(first), int(second), job_ids)
    if outcome.refusal is Refusal.TOO_LARGE:
        return InvalidArgument(
            "max_tokens",
            f"the job's {first} tokens (its prompt's estimate and max_tokens; a request's first job counts "
            f"every choice's) exceed the limit of {second} tokens per minute of tenant {tenant!r}",
        )
    if outcome.refusal is Refusal.OTHER_TYPE:
        return InvalidQueueStream(queue, str(second), tenant)
    if outcome.refusal is Refusal.RATE:
        limits = rate_limits_of(outcome)
        limit = limits.limit_requests if second == "requests" else limits.limit_tokens
        return RateLimited(queue, tenant, str(second), limit, int(first) / 1000, limits, job_ids)
    return None


def rate_limits_of(outcome: Enqueued) -> RateLimits:
    """The tenant's rate limits the enqueue answered. All six 0 (a tenant without rate limits, the
    most common): NO_RATE_LIMITS, equal to what they read as, without their generator and dataclass."""
    return RateLimits.from_reply(list(outcome.limits)) if any(outcome.limits) else NO_RATE_LIMITS
