"""MILI's producer library: submit generation jobs to a Redis queue and read their results.
Depends on redis and pydantic only, so a producer host needs no GPU stack."""

from producer_client import errors
from producer_client.aio import AsyncClient
from producer_client.bulk import ResultWatch
from producer_client.chat import ChatMessage
from producer_client.client import Client
from producer_client.errors import (
    BulkQueueFull,
    CredentialsRefused,
    IdempotencyConflict,
    InvalidArgument,
    InvalidJob,
    InvalidQueueStream,
    JobNotFound,
    JobTimeout,
    MiliError,
    PermissionDenied,
    QueueFull,
    RateLimited,
    RedisTimedOut,
    RedisUnavailable,
    UnknownAdapter,
    WaitingQuotaExceeded,
)
from producer_client.schema import (
    JobExpired,
    JobFailed,
    JobRequest,
    JobResult,
    JobStatus,
    QueueStats,
    SamplingParams,
    Timings,
    TokenDelta,
    Usage,
    WorkerInfo,
)

__all__ = [
    "AsyncClient",
    "BulkQueueFull",
    "ChatMessage",
    "Client",
    "CredentialsRefused",
    "IdempotencyConflict",
    "InvalidArgument",
    "InvalidJob",
    "InvalidQueueStream",
    "JobExpired",
    "JobFailed",
    "JobNotFound",
    "JobRequest",
    "JobResult",
    "JobStatus",
    "JobTimeout",
    "MiliError",
    "PermissionDenied",
    "QueueFull",
    "QueueStats",
    "RateLimited",
    "RedisTimedOut",
    "RedisUnavailable",
    "ResultWatch",
    "SamplingParams",
    "Timings",
    "TokenDelta",
    "UnknownAdapter",
    "Usage",
    "WaitingQuotaExceeded",
    "WorkerInfo",
    "errors",
]
