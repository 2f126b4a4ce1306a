"""A job's event stream read as token deltas, for `stream()` of both clients: `follow` opens it, and
each `JobStream.read` (steps, producer_client.steps) returns the deltas of the next events.

Events carry the text the model generated. A chat job's `start` event says how its output splits
(OutputFormat), and the reader runs the same parser over that text as the worker ran over the
whole output for the result, so the deltas' `text`, `reasoning` and `tool_calls` add up to the
result's. Splitting here rather than in the worker keeps the worker's per-token work and the
events unchanged; the price is that a stream resumed after an event reads the events before it
again, to bring the parser to where that event left it.

A job that ended with nobody streaming it and one run publishing to it kept no events (protocol v2,
producer_client/protocol/script.py's END_JOB): its stream is its result's whole output in one
delta, under the event id WHOLE_OUTPUT, then its end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from producer_client.chat_output import OutputDelta, OutputFormat, OutputParser
from producer_client.errors import JobNotFound, JobTimeout
from producer_client.event_feed import Feed
from producer_client.keys import Keys
from producer_client.protocol import job_reads
from producer_client.protocol import producer as scripts
from producer_client.protocol.clock import entry_order
from producer_client.protocol.events import EventType, shown_output_format, shown_tokens
from producer_client.schema import JobResult, TokenDelta, parse_result
from producer_client.steps import Steps, checked
from producer_client.validation import check_event_id, check_job_id, check_timeout
from producer_client.waiting import Deadline, expiry, finished, read_events, unended_expiry, unless_expired

EVENT_BATCH = 512  # events per XREAD: bounds one reply, not the stream
# The event id of the one delta of a job that kept no events: the first after "0-0", so that a
# stream resumed after it reads nothing more.
WHOLE_OUTPUT = "0-1"
# `after=` as XREAD reads it: the job's last event when the stream is opened, so only later ones.
LAST_EVENT = "$"


def follow(keys: Keys, job_id: str, after: str, timeout: float | None) -> Steps[tuple[JobStream, Deadline]]:
    """A reader of the job's events after `after`, and the deadline of `timeout` seconds for them all,
    once FOLLOW has marked the job streamed (its worker publishes its tokens within
    stream_interval_s once it sees that). `after` LAST_EVENT: after the job's last event now (the
    one delta of a job that kept no events, WHOLE_OUTPUT). Raises JobNotFound."""
    job_id = check_job_id(job_id)
    from_now = after == LAST_EVENT
    reader = JobStream(job_id, "0-0" if from_now else after)
    deadline = Deadline(job_id, check_timeout(timeout))

    def add(pipe: Any) -> None:
        scripts.follow(keys, job_id).add_to(pipe)
        job_reads.add_look(pipe, keys, job_id)
        job_reads.add_events_kept(pipe, keys, job_id)
        if from_now:
            job_reads.add_last_event(pipe, keys, job_id)

    found, (status, deadline_ms, result), redis_time, has_events, *last = checked((yield add))
    if not found:
        raise JobNotFound(job_id)
    if from_now:
        kept_none = result is not None and not has_events
        reader.resume_after = entry_order(WHOLE_OUTPUT if kept_none else last_event_id(last[0]))
    if result is not None and not has_events:
        reader.kept_no_events(result)
    elif result is None:  # not ended, or a hash no worker wrote (waiting.UNENDED): FOLLOW found it
        reader.expires_at = unended_expiry(job_id, status or "", deadline_ms, redis_time)
    else:
        reader.expires_at = expiry(job_id, status, deadline_ms, redis_time)
    return reader, deadline


def last_event_id(reply: list[tuple[str, Any]]) -> str:
    """The id of the last event (add_last_event's reply), or `0-0` where there is none yet."""
    return reply[0][0] if reply else "0-0"


class JobStream:
    def __init__(self, job_id: str, after: str):
        self.job_id = job_id
        self.resume_after = entry_order(check_event_id(after))
        self.last = "0-0"  # the last event read: the next read starts after it
        self.parser: OutputParser | None = None
        self.end: str | None = None  # the result JSON, once the end event is read
        self.expires_at: float | None = None  # when the job expires if still queued (waiting.expiry)
        self.whole: str | None = None  # the result JSON of an ended job that kept no events
        self.more_kept = False  # the last read was a whole batch: the stream may hold more now

    def kept_no_events(self, result_json: str) -> None:
        """The job has ended and kept no events: the next read returns its result's output."""
        self.whole = result_json

    def read(self, keys: Keys, deadline: Deadline, blocking: bool = True) -> Steps[list[TokenDelta]]:
        """The deltas of the next events, up to the end event: none if a blocking read within the
        deadline saw no event (not `blocking`: none there now). Raises JobExpired once a job still
        queued passes its deadline."""
        if self.whole is not None:
            whole, self.whole = self.whole, None
            return self.take_whole(whole)
        if self.expires_at is not None and time.monotonic() >= self.expires_at:
            (status, deadline_ms, _), redis_time = yield from job_reads.look(keys, self.job_id)
            self.expires_at = expiry(self.job_id, status, deadline_ms, redis_time)
        read = read_events(keys, self.job_id, self.last, EVENT_BATCH, deadline, self.expires_at, blocking)
        events = yield from unless_expired(keys, self.job_id, self.expires_at, read)
        self.more_kept = len(events) >= EVENT_BATCH
        deltas = []
        for event_id, fields in events:
            deltas += self.take(event_id, fields)
            if self.end is not None:
                break
        return deltas

    def reads_feed(self, feed: Feed) -> bool:
        """Whether the next events come from `feed` (producer_client.event_feed): not once the
        subscriber has failed, nor for the one delta of a job that kept no events."""
        return not feed.broken and self.whole is None

    def wait_s(self, deadline: Deadline) -> float:
        """How long to wait for a message before reading the stream: a blocking read's block (0
        once the caller's time is up: the read then raises JobTimeout, or JobExpired)."""
        try:
            return deadline.block_ms(self.expires_at) / 1000
        except JobTimeout:
            return 0.0

    def read_feed(self, keys: Keys, deadline: Deadline, feed: Feed) -> Steps[list[TokenDelta]]:
        """The deltas of what came on `feed` since the last call: its messages in order from the
        last event read, after a read of the stream (not blocking) where the feed is stale; a
        message that does not follow the last event read marks the feed stale, and the caller
        reads again at once. No round trip where the messages follow on."""
        messages, stale = feed.take()
        deltas = (yield from self.read(keys, deadline, blocking=False)) if stale else []
        if stale and self.more_kept and self.end is None:
            # The events already in the stream come in batches, and no message will announce the
            # next batch's: read it at once, not after a silence (a reader starting far behind, a
            # keep-alive's stream() called again, read one batch a block and never caught up).
            feed.mark_stale()
        last = entry_order(self.last)
        for message in messages:
            if self.end is not None:
                break
            if message is not None and entry_order(message.event_id) <= last:
                continue  # read already (a stale feed's read, or a message sent again)
            if message is None or message.previous != self.last:
                feed.mark_stale()  # an event missed: the next call reads the stream
                break
            deltas += self.take(message.event_id, {"type": message.kind, "data": message.data})
            last = entry_order(self.last)
        return deltas

    def result(self) -> JobResult:
        """The job's result, once the end event is read; a failed job raises JobFailed, an expired
        one JobExpired."""
        if self.end is None:
            raise RuntimeError(f"job {self.job_id!r}: its stream has not ended yet, so it has no result")
        return finished(self.job_id, self.end)

    def take_whole(self, result_json: str) -> list[TokenDelta]:
        """The output of a job that kept no events (its result JSON), as one delta (none if it has
        none or the stream resumes after it), and its end."""
        self.end = result_json
        result = parse_result(self.job_id, result_json)
        if not (result.token_ids or result.text) or entry_order(WHOLE_OUTPUT) <= self.resume_after:
            return []
        output = {"text": result.text, "reasoning": result.reasoning, "tool_calls": result.tool_calls}
        return [TokenDelta(event_id=WHOLE_OUTPUT, token_ids=result.token_ids, logprobs=result.logprobs, **output)]

    def take(self, event_id: str, fields: dict[str, str]) -> list[TokenDelta]:
        """The deltas one event adds to the stream: none for a `start` event or for an event at or
        before `after`. The `end` event sets `end` and adds what the parser held back."""
        previous, self.last = self.last, event_id
        self.expires_at = None  # it has started
        shown = entry_order(event_id) > self.resume_after
        kind = fields["type"]
        if kind == EventType.START:
            self._start(shown_output_format(fields["data"]))
            return []
        if kind == EventType.TOKENS:
            parser = self.parser
            split = None if parser is None else lambda text: self._fields(parser.push(text))
            delta = token_delta(event_id, fields["data"], split)
            return [delta] if shown else []
        if kind == EventType.END:
            self.end = fields.get("data", "")  # an end without one: parse_result's invalid_job
            rest = self.parser.finish() if self.parser is not None else None
            if rest and shown:
                # Resuming after the last tokens event reads the end again, and so this again.
                return [TokenDelta(event_id=previous, token_ids=[], **self._fields(rest))]
        return []

    def _start(self, output: OutputFormat | None) -> None:
        if self.parser is None and output is not None:
            self.parser = OutputParser(output)

    def _fields(self, parsed: OutputDelta) -> dict[str, Any]:
        """A TokenDelta's fields of a piece of the output, split."""
        fields: dict[str, Any] = {"text": parsed.content, "reasoning": parsed.reasoning}
        if parsed.tool_calls:
            fields["tool_calls"] = [call.of_job(self.job_id) for call in parsed.tool_calls]
        return fields


def token_delta(event_id: str, data: str, split: Callable[[str], dict[str, Any]] | None = None) -> TokenDelta:
    """A `tokens` event as a TokenDelta; `split` turns its text into a chat's fields (JobStream)."""
    payload = shown_tokens(data)
    text = {"text": payload["text"]} if split is None else split(payload["text"])
    return TokenDelta(event_id=event_id, token_ids=payload["ids"], logprobs=payload["logprobs"], **text)
