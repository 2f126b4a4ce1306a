"""How every MILI component talks to Redis: the clients' retry policy, which errors no retry
mends, the code of an error reply, and Redis URLs as they may be shown (without a password)."""
from __future__ import annotations

import re

import redis
import redis.asyncio.retry
import redis.exceptions
import redis.retry
from redis.backoff import ExponentialWithJitterBackoff

# Every call of the clients is safe to repeat: reads, CANCEL, and submits (CREATE never sets a
# started job back to queued; an entry enqueued twice is dropped by the worker that claims the
# second). So redis-py retries each call on a lost connection, with exponential backoff and
# jitter: 10 tries over about 4 s, which rides out a Redis restart.
RETRIES = 10
RETRY_BASE_S = 0.05
RETRY_CAP_S = 1.0
# Errors that retrying cannot mend: wrong credentials, or an ACL that forbids a command. redis-py
# raises the first two as kinds of ConnectionError, which it would otherwise retry.
FATAL_ERRORS = (redis.AuthenticationError, redis.exceptions.AuthorizationError, redis.exceptions.NoPermissionError)

_USERINFO = re.compile(r"(?<=://)([^/@]*)@")
_PASSWORD_PARAM = re.compile(r"(?<=[?&]password=)[^&]*")


class _SkipFatal:
    """A redis-py Retry that gives up at once on FATAL_ERRORS."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        def retryable(error: Exception) -> bool:
            return not isinstance(error, FATAL_ERRORS) and (is_retryable is None or is_retryable(error))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


class Retry(_SkipFatal, redis.retry.Retry):
    pass


class AsyncRetry(_SkipFatal, redis.asyncio.retry.Retry):
    pass


def retry_policy() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), RETRIES)


def async_retry_policy() -> AsyncRetry:
    return AsyncRetry(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), RETRIES)


def is_fatal(error: BaseException) -> bool:
    return isinstance(error, FATAL_ERRORS)


def reply_code(error: BaseException) -> str:
    """The first word of an error reply (NOGROUP, BUSY, UNBLOCKED...), wherever redis-py keeps it:
    it strips the words it has a class for (OOM, READONLY...) into `status_code`."""
    code = getattr(error, "status_code", None)
    if code:
        return str(code)
    text = str(error.args[0]) if error.args else ""
    return text.split(" ", 1)[0]


def redact_url(url: str) -> str:
    """`url` with its password replaced by ***, for messages and logs."""
    def hide(match: re.Match) -> str:
        user, colon, _ = match.group(1).partition(":")
        return f"{user}:***@" if colon else ("***@" if user else "@")

    return _PASSWORD_PARAM.sub("***", _USERINFO.sub(hide, url, count=1))
