"""OpenAI's errors: its error object, `{"error": {"message", "type", "param", "code"}}`, under the
status code OpenAI answers it with, an HTTP response's and a batch output line's `status_code`
(the SDKs map it to their exception classes: 400 BadRequestError, 404 NotFoundError, 429
RateLimitError, 503/504 InternalServerError, which they retry). What an HTTP answer adds
(Retry-After) and the gateway's own errors (keys, Redis, a restart) are in gateway/errors.py."""

from __future__ import annotations

from openai_format.responses import ErrorBody, ErrorResponse
from producer_client.errors import (
    IdempotencyConflict,
    InvalidArgument,
    JobNotFound,
    JobTimeout,
    MiliError,
    NotReplicated,
    OutOfRange,
    QueueFull,
    RateLimited,
    TooLong,
)
from producer_client.schema import JobExpired, JobFailed

# Failure codes of a job that mean its input was bad, found by the worker after the enqueue
# (only it tokenizes, so only it can tell a prompt longer than the context).
BAD_INPUT_CODES = frozenset(
    {"invalid_argument", "invalid_body", "body_too_large", "prompt_too_long", "kv_capacity_exceeded"}
)
# The field the worker's InvalidArgument names for its checks of a prompt's tokens (its message
# begins with it: worker/engine/intake.py).
WORKER_PROMPT_FIELD = "prompt_token_ids"


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))


def bad_request(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, "invalid_request_error", code, param)


def bound_code(below: bool, decimal: bool) -> str:
    """OpenAI's code for a number past a bound: it tells integers from decimals
    (`integer_above_max_value`, "Invalid 'n': integer above maximum value")."""
    kind = "decimal" if decimal else "integer"
    return f"{kind}_below_min_value" if below else f"{kind}_above_max_value"


def length_code(short: bool, value: object) -> str:
    """OpenAI's code for a list or an object of too few or too many items: `empty_array` for an
    empty list where one item is the least ("Invalid 'messages': empty array"),
    `object_above_max_properties` for a `metadata` of too many pairs."""
    if isinstance(value, dict):
        return "object_below_min_properties" if short else "object_above_max_properties"
    if short:
        return "empty_array" if value == [] else "array_below_min_length"
    return "array_above_max_length"


def unsupported(message: str, param: str) -> APIError:
    """A parameter OpenAI's API has and MILI cannot honour."""
    return APIError(400, message, "invalid_request_error", "unsupported_parameter", param)


ECHOED_CHARS = 64  # of a name an answer echoes (a file's, batch's, model's or job's it did not find)


def echoed(name: str) -> str:
    """`name` as an error message quotes it: its first ECHOED_CHARS characters and an ellipsis when
    longer (a 5,000-character id came back whole in its 404), enough to tell which request it was."""
    return name if len(name) <= ECHOED_CHARS else name[:ECHOED_CHARS] + "…"


def not_found(message: str, code: str, param: str | None = None) -> APIError:
    return APIError(404, message, "invalid_request_error", code, param)


def deadline_passed(message: str) -> APIError:
    return APIError(504, message, "timeout_error", "deadline_exceeded")


def job_error(error: JobFailed, prompt_param: str) -> APIError:
    """A job's failure as the request's error; a prompt longer than the context is OpenAI's
    `context_length_exceeded`, and one the worker refuses otherwise (token ids past its vocabulary)
    an `invalid_value`, each naming the request's prompt field."""
    if error.code == "prompt_too_long":
        return bad_request(error.message, prompt_param, "context_length_exceeded")
    if error.code == "invalid_argument" and error.message.startswith(f"{WORKER_PROMPT_FIELD}:"):
        return bad_request(error.message, prompt_param)
    return error_of(error)


def error_of(error: MiliError) -> APIError:
    """A client-library exception as OpenAI's error."""
    if isinstance(error, OutOfRange):  # as the gateway's own checks of a bound answer
        return bad_request(error.message, error.field, bound_code(error.below, error.decimal))
    if isinstance(error, TooLong):
        return bad_request(error.message, error.field, "string_above_max_length")
    if isinstance(error, InvalidArgument):  # the client library's bad value is OpenAI's invalid_value
        return bad_request(
            error.message, error.field, "invalid_value" if error.code == "invalid_argument" else error.code
        )
    if isinstance(error, RateLimited):  # OpenAI's type names the limit: "requests" or "tokens"
        return APIError(429, error.message, error.which, error.code)
    if isinstance(error, QueueFull):
        return APIError(429, error.message, "rate_limit_error", error.code)
    if isinstance(error, JobNotFound):
        return not_found(JobNotFound(echoed(error.job_id)).message, "job_not_found")
    if isinstance(error, (JobTimeout, JobExpired)):
        return deadline_passed(error.message)
    if isinstance(error, JobFailed):
        if error.code == "prompt_too_long":
            return bad_request(error.message, code="context_length_exceeded")
        if error.code in BAD_INPUT_CODES:  # the worker's bad value is OpenAI's invalid_value, as the client's
            return bad_request(error.message, code="invalid_value" if error.code == "invalid_argument" else error.code)
        return APIError(500, error.message, "server_error", error.code)
    if isinstance(error, IdempotencyConflict):
        message = "this Idempotency-Key was first used with another request; send a new key with a new request"
        return APIError(422, message, "invalid_request_error", error.code, "Idempotency-Key")
    if isinstance(error, NotReplicated):  # enqueued all the same: a retry with its Idempotency-Key finds its jobs
        return APIError(503, error.message, "service_unavailable_error", error.code)
    return APIError(500, error.message, "server_error", error.code)
