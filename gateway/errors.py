"""The gateway's errors over HTTP: OpenAI's (openai_format.errors), with a Retry-After where the
client should wait before it tries again, and the gateway's own: a missing key, Redis away, a
restart."""

from __future__ import annotations

import redis

from openai_format.errors import APIError, error_of
from producer_client.errors import MiliError, NotReplicated, QueueFull


class RetryLater(APIError):
    """An error whose answer says when to try again (Retry-After): the SDKs wait that long before
    they retry."""

    def __init__(self, status: int, message: str, type: str, code: str, retry_after_s: int):
        super().__init__(status, message, type, code)
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, error: APIError, retry_after_s: int) -> RetryLater:
        body = error.body.error
        return cls(error.status, body.message, body.type, body.code, retry_after_s)


def headers_of(error: APIError) -> dict[str, str]:
    return {"Retry-After": str(error.retry_after_s)} if isinstance(error, RetryLater) else {}


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
    A full queue (429) and writes not yet on the replicas (503) are answered with a Retry-After."""
    if isinstance(error, (QueueFull, NotReplicated)):
        return RetryLater.of(error_of(error), retry_after_s)
    if isinstance(error, MiliError):
        return error_of(error)
    if isinstance(error, redis.RedisError):
        return APIError(
            503, f"the queue's Redis is unavailable: {error}", "service_unavailable_error", "redis_unavailable"
        )
    return None
