"""OpenAI's batch file format, one request per input line and one answer per output line, shared
by `mili batch` (local files) and the gateway's Batch API (files in Redis).

    input:  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    output: {"id": "batch_req_...", "custom_id": "a", "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A line's body is the same request as POST /v1/chat/completions or /v1/completions: it is
validated and turned into jobs by the same code (job_specs), and its answer is rendered by the
same renderers (render), so a batch answers exactly what the HTTP API would. A request that fails
(a bad body, a failed job) is answered with its HTTP status and OpenAI's error body, as the HTTP
API would answer it; a line that is not a request at all (not JSON, no custom_id, an unknown url)
is a LineError, which names the line.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openai_format.errors import APIError, bad_request, error_of, job_error
from openai_format.job_specs import JobSpec, chat_jobs, check_jobs, completion_jobs, named_as_requested, parse_body
from openai_format.render import ChatRenderer, CompletionRenderer, Renderer
from openai_format.requests import ChatCompletionRequest, CompletionRequest, SamplingRequest
from producer_client import JobResult
from producer_client.errors import BulkQueueFull, InvalidArgument
from producer_client.new_job import lane_of
from producer_client.schema import JobFailed


@dataclass(frozen=True)
class Endpoint:
    request: type[SamplingRequest]
    jobs_of: Callable[[Any], list[JobSpec]]
    renderer: type[Renderer]
    id_prefix: str


# The lane of a batch line's jobs, unless its body names one (service_tier): batch work waits for
# interactive work (docs/architecture.md, "Sharing rules").
BATCH_SERVICE_TIER = "flex"

ENDPOINTS = {
    "/v1/chat/completions": Endpoint(ChatCompletionRequest, chat_jobs, ChatRenderer, "chatcmpl"),
    "/v1/completions": Endpoint(CompletionRequest, completion_jobs, CompletionRenderer, "cmpl"),
}


class LineError(Exception):
    """An input line that is not a request: `line` is its number (from 1)."""

    def __init__(self, line: int, code: str, message: str, param: str | None = None, custom_id: str | None = None):
        super().__init__(f"line {line}: {message}")
        self.line = line
        self.code = code
        self.message = message
        self.param = param
        self.custom_id = custom_id

    def error(self) -> LineErrorBody:
        return LineErrorBody(code=self.code, message=self.message, param=self.param, line=self.line)


class InputLine(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclass(frozen=True)
class LineRequest:
    """A line that is a request: its endpoint, its body as that endpoint's request, and its jobs."""

    line: int
    custom_id: str
    endpoint: Endpoint
    body: dict[str, Any]
    request: SamplingRequest
    specs: list[JobSpec]
    jobs_bytes: int  # what its jobs' bodies take in Redis together (check_jobs)

    def request_id(self, scope: str, tenant: str | None) -> str:
        return request_id(scope, self.custom_id, self.body, tenant)

    @property
    def service_tier(self) -> str:
        """The service tier its jobs run at: the body's, else BATCH_SERVICE_TIER."""
        return next((spec.service_tier for spec in self.specs if spec.service_tier), BATCH_SERVICE_TIER)


@dataclass
class LineJobs:
    """A request line in flight: its jobs (`<request id>-<choice>`), the queue they go to (None: the
    client's own), and their results so far."""

    request: LineRequest
    request_id: str
    queue: str | None = None
    results: dict[str, JobResult] = field(default_factory=dict)
    adapter: str | None = None  # the LoRA adapter its model names

    @property
    def job_ids(self) -> list[str]:
        return [f"{self.request_id}-{i}" for i in range(len(self.request.specs))]

    def submit_specs(self, **options: Any) -> list[dict]:
        """submit_many's specs of the line's jobs, with `options` (timeout_s...) added."""
        tier = self.request.service_tier
        return [
            {
                **replace(spec, adapter=self.adapter).submit_kwargs(),
                "service_tier": tier,
                "request_id": job_id,
                **options,
            }
            for spec, job_id in zip(self.request.specs, self.job_ids)
        ]

    def add(self, result: JobResult) -> bool:
        """Record a job's result; True once every job of the line has one."""
        self.results[result.id] = result
        return len(self.results) == len(self.request.specs)

    def in_choice_order(self) -> list[JobResult]:
        return [self.results[job_id] for job_id in self.job_ids]


def split_at_full_queue(lines: list[LineJobs], full: BulkQueueFull) -> tuple[list[LineJobs], list[LineJobs]]:
    """The lines that a submit_many which met a full queue enqueued whole, and those that wait for
    room, each in their order. A line with any job left out waits whole: submitted again, the jobs
    of it that got in are found by their request ids, not added twice."""
    enqueued = set(full.job_ids)
    taken: list[LineJobs] = []
    waiting: list[LineJobs] = []
    for line in lines:
        (taken if enqueued.issuperset(line.job_ids) else waiting).append(line)
    return taken, waiting


def request_id(scope: str, custom_id: str, body: dict[str, Any], tenant: str | None = None) -> str:
    """A line's request id within `scope` (a batch file, a batch): its jobs are
    `<request id>-<choice>`, so a line submitted again finds its jobs. The body is part of it: a
    line changed between two runs is another request. A job's id records its tenant, up to its
    first dot (producer_client.new_job.fresh_job_id): a tenant's line's id begins `<tenant>.`, so
    that the gateway's key and a producer user pinned to the tenant own its jobs; one of no tenant
    holds no dot (`batch.` named a tenant `batch`, who would have owned every batch's jobs)."""
    digest = hashlib.sha256(json.dumps([scope, custom_id, body], sort_keys=True).encode()).hexdigest()
    return f"batch-{digest[:40]}" if tenant is None else f"{tenant}.batch-{digest[:40]}"


BOM = "\ufeff"


def without_bom(text: str) -> str:
    """A file's text without the UTF-8 byte order mark that Windows tools (Notepad, PowerShell's
    Out-File, Excel) write at its start: it is no JSON, and failed line 1 as invalid_json."""
    return text.removeprefix(BOM)


def jsonl_lines(text: str, keepends: bool = False) -> list[str]:
    """JSON Lines split as the format defines them: on \n only. str.splitlines also splits on
    U+2028, U+2029, U+0085 and other boundaries, which a JSON string may hold raw: a request would
    become two broken lines, and every line number after it wrong. A \r before a \n (a CRLF
    file) is JSON whitespace and stays with its line."""
    lines = text.split("\n")
    if not keepends:
        return lines
    return [line + "\n" for line in lines[:-1]] + ([lines[-1]] if lines[-1] else [])


def parse_line(text: str, number: int, urls: frozenset[str] = frozenset(ENDPOINTS)) -> InputLine:
    """The line as an InputLine whose url is one of `urls`, else a LineError."""
    try:
        line = InputLine.model_validate_json(text)
    except ValidationError as e:
        first = e.errors()[0]
        if first["type"] in ("json_invalid", "json_type"):
            raise LineError(number, "invalid_json", f"not a JSON object: {first['msg']}") from None
        param = ".".join(str(p) for p in first["loc"]) or None
        # A line of JSON that is no object has no field to name: its error is the line's own.
        message = f"{param}: {first['msg']}" if param is not None else f"the line is not a JSON object: {first['msg']}"
        raise LineError(number, "invalid_line", message, param, custom_id_of(text)) from None
    if line.url not in urls:
        allowed = " or ".join(sorted(urls))
        raise LineError(number, "invalid_url", f"url {line.url!r} is not {allowed}", "url", line.custom_id)
    return line


def check_lines(text: str, url: str, max_lines: int, max_errors: int = 100) -> tuple[list[str], list[LineError]]:
    """A batch input file's request lines (blank ones left out), and what is wrong with it: too
    many lines, lines that are not requests, a url other than the batch's, a custom_id twice. The
    first `max_errors` errors are kept. A byte order mark at the file's start is no part of line 1."""
    numbered = [(number, line) for number, line in enumerate(jsonl_lines(without_bom(text)), 1) if line.strip()]
    if len(numbered) > max_lines:
        return [], [
            LineError(numbered[max_lines][0], "too_many_lines", f"{len(numbered)} lines, the limit is {max_lines}")
        ]
    errors: list[LineError] = []
    seen: set[str] = set()
    for number, text_line in numbered:
        try:
            noted_line(text_line, number, seen, frozenset({url}))
        except LineError as e:
            errors.append(e)
            if len(errors) == max_errors:
                break
    return [line for _, line in numbered], errors


def noted_line(text: str, number: int, seen: set[str], urls: frozenset[str] = frozenset(ENDPOINTS)) -> InputLine:
    """parse_line, and the line's custom_id added to those `seen` on earlier lines; one seen
    already is a LineError (the Batch API refuses a file that repeats one: answers are matched to
    requests by it). A line that is no request notes its custom_id too, where it has one: a later
    line repeating it was taken for the first, and its answer shared the custom_id of the error's."""
    try:
        line = parse_line(text, number, urls)
    except LineError as e:
        if e.custom_id is not None:
            seen.add(e.custom_id)
        raise
    if line.custom_id in seen:
        raise LineError(
            number,
            "duplicate_custom_id",
            f"custom_id {line.custom_id!r} is on an earlier line",
            "custom_id",
            line.custom_id,
        )
    seen.add(line.custom_id)
    return line


def custom_id_of(text: str) -> str | None:
    try:
        value = json.loads(text).get("custom_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def line_request(line: InputLine, number: int, max_jobs_bytes: int | None = None) -> LineRequest:
    """The line's request and jobs, validated as the HTTP API validates them (each job as the
    client library will, and together within `max_jobs_bytes`, the gateway's
    max_request_jobs_bytes; None: `mili batch`, which submits with its caller's own access to
    Redis): an APIError (400) for a bad body."""
    endpoint = ENDPOINTS[line.url]
    request = parse_body(endpoint.request, json.dumps(line.body))
    if request.stream:
        raise bad_request("a batch request cannot stream", "stream")
    specs = endpoint.jobs_of(request)
    try:
        size = check_jobs(specs, None, False, max_jobs_bytes)
    except InvalidArgument as e:
        raise error_of(named_as_requested(e, request)) from None
    return LineRequest(number, line.custom_id, endpoint, line.body, request, specs, size.bytes)


# -- output lines ------------------------------------------------------------------------------


class Output(BaseModel):
    model_config = ConfigDict(frozen=True)


class LineResponse(Output):
    status_code: int
    request_id: str
    body: dict[str, Any]


class LineErrorBody(Output):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class OutputLine(Output):
    id: str
    custom_id: str | None
    response: LineResponse | None = None
    error: LineErrorBody | None = None

    @property
    def ok(self) -> bool:
        """A 200 answer: it belongs in the output file; anything else in the error file."""
        return self.response is not None and self.response.status_code == 200

    def completion_tokens(self) -> int:
        usage = self.response.body.get("usage") if self.ok else None
        return usage["completion_tokens"] if usage else 0


def line_id(request_id: str) -> str:
    return "batch_req_" + hashlib.sha256(request_id.encode()).hexdigest()[:32]


def answer(req: LineRequest, request_id: str, results: list[JobResult]) -> OutputLine:
    """The line's answer from its jobs' results (in choice order), as the HTTP API would give it."""
    failed = next((r for r in results if r.status == "failed"), None)
    if failed is not None:
        code, message = (failed.error.code, failed.error.message) if failed.error else ("error", "failed")
        prompt = "messages" if req.endpoint.request is ChatCompletionRequest else "prompt"
        return error_answer(req.custom_id, request_id, job_error(JobFailed(code, message, failed), prompt))
    prompt_of = [spec.prompt_index for spec in req.specs]
    renderer = req.endpoint.renderer(
        f"{req.endpoint.id_prefix}-{request_id}", req.request.model, prompt_of, lane_of(req.service_tier)
    )
    try:
        body = renderer.response(results).model_dump(mode="json")
    except APIError as e:  # a job that passed its deadline: 504, as over HTTP
        return error_answer(req.custom_id, request_id, e)
    response = LineResponse(status_code=200, request_id=request_id, body=body)
    return OutputLine(id=line_id(request_id), custom_id=req.custom_id, response=response)


def error_answer(custom_id: str, request_id: str, error: APIError) -> OutputLine:
    """A request answered with an HTTP error (a bad body, a failed job), OpenAI's error body in it."""
    body = error.body.model_dump(mode="json")
    return OutputLine(
        id=line_id(request_id),
        custom_id=custom_id,
        response=LineResponse(status_code=error.status, request_id=request_id, body=body),
    )


def unanswered(custom_id: str | None, request_id: str, code: str, message: str) -> OutputLine:
    """A line that got no answer: its batch was cancelled or expired first."""
    return OutputLine(id=line_id(request_id), custom_id=custom_id, error=LineErrorBody(code=code, message=message))


def not_a_request(error: LineError, scope: str) -> OutputLine:
    return OutputLine(id=line_id(f"{scope}:line:{error.line}"), custom_id=error.custom_id, error=error.error())
