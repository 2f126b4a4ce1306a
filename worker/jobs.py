"""A job as the worker sees it: a queue entry turned into token ids (or into a failure
with a code), then the deltas it accumulates until its result."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from producer_client.errors import InvalidBody, MiliError, UnsupportedVersion
from producer_client.keys import NAME_PATTERN, PROTOCOL_VERSION
from producer_client.schema import ErrorInfo, JobRequest, JobResult, JobState, Timings, TokenLogprob, Usage


@dataclass
class Job:
    id: str
    entry_id: str
    request: JobRequest
    prompt_token_ids: list[int]
    queued_at: float
    started_at: float
    first_token_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | None = None  # why this worker aborted it: "cancel" or "timeout"

    @property
    def deadline(self) -> float | None:
        timeout = self.request.timeout_s
        return None if timeout is None else self.queued_at + timeout

    def result(
        self, status: JobState, finish_reason: str | None, usage: Usage, worker: str, error: ErrorInfo | None = None,
    ) -> JobResult:
        return JobResult(
            id=self.id, status=status, text="".join(self.text), token_ids=self.token_ids,
            finish_reason=finish_reason, usage=usage, error=error, logprobs=self.logprobs, worker=worker,
            timings=Timings(
                queued_at=self.queued_at, started_at=self.started_at, first_token_at=self.first_token_at,
                finished_at=time.time(),
            ),
        )


def entry_time(entry_id: str) -> float:
    """When Redis added the entry: the milliseconds part of its id."""
    return int(entry_id.split("-", 1)[0]) / 1000


def job_id_of(entry_id: str, fields: dict[str, str]) -> str:
    """The entry's job id; an entry without a usable one is reported under `entry-<entry id>`."""
    job_id = fields.get("id", "")
    return job_id if NAME_PATTERN.fullmatch(job_id) else f"entry-{entry_id}"


def parse_request(fields: dict[str, str], max_body_bytes: int, max_tokens_limit: int) -> JobRequest:
    """The entry's JobRequest, or a MiliError whose code the failed job will carry."""
    if not NAME_PATTERN.fullmatch(fields.get("id", "")):
        raise InvalidBody("the entry has no valid `id` field")
    if fields.get("v") != str(PROTOCOL_VERSION):
        raise UnsupportedVersion(f"protocol version {fields.get('v')!r}; this worker speaks {PROTOCOL_VERSION}")
    if "body" not in fields:
        raise InvalidBody("the entry has no `body` field")
    try:
        # The worker's connection decodes with surrogateescape: invalid bytes surface here.
        body = fields["body"].encode()
    except UnicodeEncodeError:
        raise InvalidBody("the body is not valid UTF-8") from None
    return JobRequest.from_json(body, max_body_bytes, max_tokens_limit)


def prompt_token_ids(request: JobRequest, tokenizer) -> list[int]:
    """Tokenize here, in the worker, so that producers need no tokenizer; chat messages go
    through the checkpoint's own (sandboxed) chat template."""
    if request.input_ids is not None:
        return list(request.input_ids)
    if request.messages is not None:
        messages = [m.model_dump() for m in request.messages]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return tokenizer.encode(request.prompt)


def failed_result(job_id: str, entry_id: str, error: MiliError, worker: str) -> JobResult:
    """The result of an entry that never ran."""
    return JobResult(
        id=job_id, status="failed", finish_reason="error", worker=worker,
        error=ErrorInfo(code=error.code, message=error.message),
        timings=Timings(queued_at=entry_time(entry_id), finished_at=time.time()),
    )


def expired_result(job_id: str, entry_id: str, worker: str) -> JobResult:
    return JobResult(
        id=job_id, status="expired", worker=worker,
        timings=Timings(queued_at=entry_time(entry_id), finished_at=time.time()),
    )


def token_event(token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None) -> str:
    payload: dict = {"ids": token_ids, "text": text}
    if logprobs is not None:
        payload["logprobs"] = [lp.model_dump() for lp in logprobs]
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
