"""A job as the worker sees it, once its entry is read (worker/loop/intake.py): its run, its
prompt's token ids and the deltas it accumulates until its result; how far they have gone
towards Redis (Feed); its final result (Job.result, final_result); and the errors a job fails
with in the loop. A reclaimed job starts from the tokens its event stream recorded."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from producer_client.chat_output import ChatOutput, OutputFormat, OutputParser, parse_output
from producer_client.errors import MiliError
from producer_client.protocol.clock import entry_time
from producer_client.protocol.events import EventType, resumed_start, resumed_tokens
from producer_client.schema import ErrorInfo, JobRequest, JobResult, JobState, Timings, TokenLogprob, Usage
from worker.engine.grammar.constraint import Constraint
from worker.loop.streams import DEFAULT_ROUTE, Route


class Poison(MiliError):
    """The job's entry was delivered more than max_deliveries times: every worker that took it
    stopped before finishing it. It is moved to the dead-letter stream."""

    code = "poison"


class InternalError(MiliError):
    """A bug met while handling one job, or a reply the protocol does not define; the job fails
    and the worker keeps serving."""

    code = "internal_error"


class InvalidJob(MiliError):
    """The job's keys in Redis are not what the protocol defines (a key of another type, a field
    no script can read, events that disagree with the hash): producers may write those keys. The
    job fails; the worker keeps serving."""

    code = "invalid_job"


class AdmissionId(NamedTuple):
    """One admission of a job to the engine: the engine's request id for it, which every output
    carries back. Each admission has a number of its own, so that the final output of an aborted
    earlier one (after a failed step, or a run this worker lost and took back) is never taken for
    this one's. A tuple: its hash and equality are C's, where a frozen dataclass's are two Python
    calls each time the engine or the loop looks a request up (eight a job)."""

    job_id: str
    number: int

    def __str__(self) -> str:  # the engine logs request ids
        return f"{self.job_id}#{self.number}"


@dataclass(slots=True)
class Feed:
    """How far a claimed job's output has gone towards Redis: how much of it some update holds
    already (outbox.Update.take moves the rest in), since when the rest has waited, when the worker
    last heard from the job's hash (a publication, or a look at its flags), and whether someone
    reads its tokens as they come (the job's `stream` option, or a reader's FOLLOW)."""

    streamed: bool
    tokens: int = 0  # of job.token_ids
    pieces: int = 0  # of job.text
    logprobs: int = 0  # of job.logprobs
    waiting_since: float | None = None  # monotonic time of the oldest output no update holds
    # Monotonic. A job is made as its claim reads its hash: that counts as a look.
    looked_at: float = field(default_factory=time.monotonic)
    # Monotonic. A streamed job publishes no sooner than this (worker/loop/pace.py: its slots).
    next_slot: float = 0.0

    def behind(self, job: Job) -> bool:
        """Whether the job has output no update holds."""
        return self.tokens < len(job.token_ids) or self.pieces < len(job.text)

    def catch_up(self, job: Job) -> None:
        """Everything the job has now counts as held by an update (recorded, or about to be)."""
        self.tokens, self.pieces = len(job.token_ids), len(job.text)
        self.logprobs = len(job.logprobs or ())
        self.waiting_since = None


# Slots (Job, Feed): the loop reads every running job's and its feed's fields each step and each
# iteration (collection.py, pace.py); fields in the object itself are fewer cache lines to miss
# after a step's wait (bench/RESULTS.md, x/whole).
@dataclass(slots=True)
class Job:
    id: str
    # None once the job is detached from its entry: Redis lost the queue's group, and the worker
    # runs the job on (see ADOPT in producer_client.protocol.worker).
    entry_id: str | None
    run: str  # the fencing token of this worker's claim (see producer_client.protocol.worker)
    request: JobRequest
    prompt_token_ids: list[int]
    queued_at: float  # on Redis's clock, as every time here
    started_at: float
    first_token_at: float | None = None
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | None = None  # why this worker aborted it: "cancel", "timeout" or "tool_call"
    resumed_tokens: int = 0  # tokens recorded by earlier runs when this one started
    engine_id: AdmissionId | None = None  # the engine's request id for the job's current admission
    # When the job times out: the `deadline` its producer's CREATE recorded, else its entry's
    # time plus timeout_s (an entry added without the client). None: no timeout.
    deadline: float | None = None
    output_format: OutputFormat | None = None  # how a chat's output splits; None: it is all text
    constraint: Constraint | None = None  # what its output must match (structured outputs, forced tool calls)
    route: Route = DEFAULT_ROUTE  # its entry's lane and tenant: the lane ranks it in the engine
    # With parallel_tool_calls off, the output as it grows: the job stops at its first tool call.
    call_watch: OutputParser | None = field(init=False, default=None)
    called_before: bool = field(init=False, default=False)  # an earlier run made that call: nothing is left to run
    feed: Feed = field(init=False)

    def __post_init__(self) -> None:
        if self.deadline is None and self.request.timeout_s is not None:
            self.deadline = self.queued_at + self.request.timeout_s
        self.feed = Feed(streamed=self.request.stream)
        fmt = self.output_format
        if fmt is not None and fmt.tools is not None and not self.request.parallel_tool_calls:
            self.call_watch = OutputParser(fmt)

    def watch_for_call(self, text: str) -> bool:
        """Whether the output, grown by `text`, has made the one tool call it may make."""
        return self.call_watch is not None and bool(self.call_watch.push(text).tool_calls)

    def resume(self, events: list[tuple[str, dict[str, str]]]) -> None:
        """Take over the tokens, text and logprobs that earlier runs recorded, and when the first
        of them started and produced its first token."""
        starts = []
        for event_id, fields in events:
            if fields.get("type") == EventType.START:
                starts.append(resumed_start(fields.get("data", "")))
            elif fields.get("type") == EventType.TOKENS:
                tokens = resumed_tokens(fields.get("data", ""))
                if self.first_token_at is None and tokens.ids:
                    self.first_token_at = entry_time(event_id)
                self.token_ids.extend(tokens.ids)
                self.text.append(tokens.text)
                if tokens.logprobs is not None and self.request.params.logprobs is not None:
                    self.logprobs = (self.logprobs or []) + tokens.logprobs
        if starts:
            self.started_at = starts[0].started_at
        self.resumed_tokens = len(self.token_ids)
        self.feed.catch_up(self)
        self.called_before = self.watch_for_call("".join(self.text))

    def usage(self) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_token_ids), completion_tokens=len(self.token_ids))

    def result(
        self,
        status: JobState,
        finish_reason: str | None,
        worker: str,
        now: float,
        usage: Usage | None = None,
        error: MiliError | ErrorInfo | None = None,
    ) -> JobResult:
        """The job's final result, with its output so far (usage: the engine's, else counted here).
        A chat's output is split into answer, reasoning and tool calls; one that ended naturally
        with calls ends for them (`tool_calls`)."""
        text = "".join(self.text)
        chat = None if self.output_format is None else parse_output(text, self.output_format)
        if chat is not None and chat.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return final_result(
            self.id,
            status,
            finish_reason,
            worker,
            now,
            self.queued_at,
            usage=usage or self.usage(),
            error=error,
            output=(self.token_ids, text, self.logprobs),
            chat=chat,
            started_at=self.started_at,
            first_token_at=self.first_token_at,
        )


def final_result(
    job_id: str,
    status: JobState,
    finish_reason: str | None,
    worker: str,
    now: float,
    queued_at: float,
    *,
    usage: Usage | None = None,
    error: MiliError | ErrorInfo | None = None,
    output: tuple[list[int], str, list[TokenLogprob] | None] = ([], "", None),
    chat: ChatOutput | None = None,
    started_at: float | None = None,
    first_token_at: float | None = None,
) -> JobResult:
    """The one way a job's final result is built: a job that ran (Job.result), or an entry that
    never did (failed on reading, expired unread, dead-lettered)."""
    token_ids, text, logprobs = output
    # The worker's times are Redis's clock as this process estimates it, to within half a round
    # trip, while queued_at is Redis's own, in whole ms: a job started at once could read as
    # started before it was queued (`queue -0.001s`). No time precedes the one before it.
    if started_at is not None:
        started_at = max(started_at, queued_at)
    if first_token_at is not None:
        first_token_at = max(first_token_at, started_at or queued_at)
    now = max(now, first_token_at or started_at or queued_at)
    if isinstance(error, MiliError):
        error = ErrorInfo(code=error.code, message=printable(error.message))
    reasoning, tool_calls = "", []
    if chat is not None:
        text, reasoning, tool_calls = chat.content, chat.reasoning, [c.of_job(job_id) for c in chat.tool_calls]
    return JobResult(
        id=job_id,
        status=status,
        text=text,
        reasoning=reasoning,
        tool_calls=tool_calls,
        token_ids=token_ids,
        finish_reason=finish_reason,
        usage=usage or Usage(),
        error=error,
        logprobs=logprobs,
        worker=worker,
        timings=Timings(queued_at=queued_at, started_at=started_at, first_token_at=first_token_at, finished_at=now),
    )


def printable(message: str) -> str:
    """`message` as valid UTF-8: a producer's invalid bytes (surrogate-escaped on our connection)
    may be quoted in an error message, and must not make the result unwritable."""
    return message.encode("utf-8", "backslashreplace").decode("utf-8")
