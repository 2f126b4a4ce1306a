"""The gateway's errors over HTTP: OpenAI's (openai_format.errors), with a Retry-After where the
client should wait before it tries again, `x-should-retry: false` where trying again cannot help,
and the gateway's own: a missing key, Redis away, a restart."""

from __future__ import annotations

import math

import redis

from openai_format.errors import APIError, error_of
from producer_client.connection import is_fatal, is_other_type
from producer_client.errors import (
    CredentialsRefused,
    InvalidJob,
    InvalidQueueStream,
    MiliError,
    NotReplicated,
    QueueFull,
    RateLimited,
    RedisUnavailable,
    WritesRefused,
)


class RetryLater(APIError):
    """An error whose answer says when to try again (Retry-After, in whole seconds; retry-after-ms
    too, which OpenAI's SDKs read first): the SDKs wait that long before they retry."""

    def __init__(self, status: int, message: str, type: str, code: str, retry_after_s: float):
        super().__init__(status, message, type, code)
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, error: APIError, retry_after_s: float) -> RetryLater:
        body = error.body.error
        return cls(error.status, body.message, body.type, body.code, retry_after_s)


class Final(APIError):
    """A 5xx error that asking again will not mend (a job whose keys hold what no worker writes, Redis
    refusing the gateway's user): its answer says `x-should-retry: false`, which OpenAI's SDKs obey
    before their rule of retrying every 5xx."""

    @classmethod
    def of(cls, error: APIError) -> Final:
        body = error.body.error
        return cls(error.status, body.message, body.type, body.code)


# RFC 9110 11.6.1: a 401 must name how to authenticate; the gateway takes its API keys as Bearer tokens.
WWW_AUTHENTICATE = 'Bearer realm="MILI"'


def headers_of(error: APIError) -> dict[str, str]:
    if isinstance(error, Final):
        return {"x-should-retry": "false"}
    if isinstance(error, RetryLater):
        return retry_after_headers(error.retry_after_s)
    if error.status == 401:
        return {"WWW-Authenticate": WWW_AUTHENTICATE}
    return {}


def retry_after_headers(retry_after_s: float) -> dict[str, str]:
    """When to try again, as every answer that says it sends it (a 429, a 503): Retry-After in whole
    seconds (HTTP's), never sooner than meant, and retry-after-ms, which OpenAI's SDKs read first."""
    return {
        "Retry-After": str(max(1, math.ceil(retry_after_s))),
        "retry-after-ms": str(max(1, math.ceil(retry_after_s * 1000))),
    }


def unauthorized() -> APIError:
    return APIError(
        401, "missing or incorrect API key in `Authorization: Bearer`", "invalid_request_error", "invalid_api_key"
    )


def gateway_stopping() -> APIError:
    return APIError(
        503,
        "the gateway is restarting; send the request again (with the same Idempotency-Key to keep its jobs)",
        "service_unavailable_error",
        "gateway_stopping",
    )


def api_error_of(error: Exception, retry_after_s: int) -> APIError | None:
    """The HTTP error for a client-library or Redis exception; None for anything else (a bug: 500).
    A full queue (429), a rate limit (429, after its reset) and writes not yet on the replicas
    (503) are answered with a Retry-After; a job whose keys hold what no worker writes (500
    invalid_job), a stream of the queue's jobs of another type (500 invalid_queue_stream) and any
    other key of another type (500 key_of_another_type) as Final."""
    if isinstance(error, RateLimited):  # admitted once its bucket has dripped back: reset_s from now
        return RetryLater.of(error_of(error), error.reset_s)
    if isinstance(error, (QueueFull, NotReplicated)):
        return RetryLater.of(error_of(error), retry_after_s)
    if isinstance(error, (InvalidJob, InvalidQueueStream)):
        return Final.of(error_of(error))
    if is_fatal(error):  # no retry mends it: the gateway's Redis user lacks a right, or its password is wrong
        return Final(
            500,
            f"the queue's Redis refused the gateway's user: {type(error).__name__}: {refusal_of(error)} "
            "(fix the URL or the ACL)",
            "server_error",
            "redis_refused",
        )
    if is_other_type(error):  # one the client reads as missing, or raises as its own, never gets here
        return key_of_another_type()
    if isinstance(error, RedisUnavailable):  # the client's error names the server; redis-py's text does too
        return unavailable(error.detail)
    if isinstance(error, WritesRefused):  # memory full or a replica's copy: as Redis away, for now
        return unavailable(error.message)
    if isinstance(error, MiliError):
        return error_of(error)
    if isinstance(error, redis.RedisError):
        return unavailable(str(error))
    return None


def refusal_of(error: Exception) -> str:
    """What Redis refused, as the gateway's answer says it: never the URL nor its credentials
    (CredentialsRefused's `detail` is Redis's reason alone)."""
    return error.detail if isinstance(error, CredentialsRefused) else str(error)


def key_of_another_type() -> Final:
    """A WRONGTYPE: a key the request met holds another type than MILI writes there (the Batch API's
    files and batches, which the gateway's user alone writes: an operator's mistake). It was a 503
    redis_unavailable, which the SDKs retry; no retry mends it until someone deletes the key
    (Redis's reply does not say which)."""
    return Final(
        500,
        "a key of the queue's Redis that this request reads holds another type than MILI writes there "
        "(WRONGTYPE): an operator deletes it",
        "server_error",
        "key_of_another_type",
    )


def unavailable(cause: str) -> APIError:
    return APIError(503, f"the queue's Redis is unavailable: {cause}", "service_unavailable_error", "redis_unavailable")
