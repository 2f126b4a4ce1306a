"""A batch run's lines between their submission and their answers: the loop both batch drivers
run, `mili batch` over a local file (cli/batch_file.py) and the gateway's Batch API over its
store (gateway/batch/driver.py), without its I/O. Each driver runs it over its own client (sync
or asyncio), its own source of lines and its own place for answers:

    while the run goes on:
        while flight.room() > 0: flight.add(<the next line's jobs>)
        for lines in flight.due().values(): flight.submitted(lines, <submit_many's refusal, or None>)
        for line in flight.ended(<client.finished(flight.watch)>): <write the line's answer>

At most `limit` is out at a time, a line weighing `weight(line)` from its adding to its answer:
the gateway counts lines, `mili batch` jobs. The gateway bounds the bytes of the jobs out too
(`max_bytes`): a line that does not fit waits for earlier ones to be answered (`fits`), and goes
alone into an empty flight whatever its size. A full queue (other producers) takes the lines it
has room for whole; the others wait QUEUE_FULL_WAIT_S, and no line is added meanwhile. So do the
lines the tenant's waiting quota refused, and those over its rate limits until their reset. A waiting
line goes again whole: its jobs that got in are found by their request ids, not added twice
(batch_lines.split_at_full_queue)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from openai_format.batch_lines import LineJobs, split_at_full_queue
from producer_client import BulkQueueFull, JobResult, RateLimited, ResultWatch, WaitingQuotaExceeded
from producer_client.keys import Keys

QUEUE_FULL_WAIT_S = 1.0
# What stops a submit_many part-way, naming the jobs that got in: the lines after them wait.
REFUSALS = (BulkQueueFull, WaitingQuotaExceeded, RateLimited)
Refusal = BulkQueueFull | WaitingQuotaExceeded | RateLimited


class Flight:
    def __init__(self, keys: Keys, limit: int, weight: Callable[[LineJobs], int], max_bytes: int | None = None):
        self.limit = limit
        self.weight = weight
        self.max_bytes = max_bytes  # None: no bound
        self.watch = ResultWatch(keys)  # the jobs submitted and not ended
        self.line_of: dict[str, LineJobs] = {}  # job id -> its line, for each job in `watch`
        self.waiting: list[LineJobs] = []  # added and not yet taken by their queue
        self.load = 0  # the weight of the lines added and not yet answered
        self.bytes = 0  # their jobs' bytes (LineRequest.jobs_bytes)
        self.retry_at = 0.0  # a full queue is tried again from then on

    def room(self) -> int:
        """The weight that may be added now: none while a full queue is waited for."""
        if time.monotonic() < self.retry_at:
            return 0
        return max(0, self.limit - self.load)

    def fits(self, line: LineJobs) -> bool:
        """Whether `line` may be added now: room for its weight and its bytes, or an empty flight."""
        if self.room() < self.weight(line):
            return False
        return self.max_bytes is None or self.load == 0 or self.bytes + line.request.jobs_bytes <= self.max_bytes

    def add(self, line: LineJobs) -> None:
        self.waiting.append(line)
        self.load += self.weight(line)
        self.bytes += line.request.jobs_bytes

    def due(self) -> dict[str | None, list[LineJobs]]:
        """The lines to submit now, by queue (None: the client's own), each queue's in their
        order: every line waiting, or none while a full queue is waited for."""
        if time.monotonic() < self.retry_at:
            return {}
        by_queue: dict[str | None, list[LineJobs]] = {}
        for line in self.waiting:
            by_queue.setdefault(line.queue, []).append(line)
        self.waiting = []
        return by_queue

    def submitted(self, lines: list[LineJobs], full: Refusal | None = None) -> list[LineJobs]:
        """`lines`, one queue's, went to one submit_many, which met `full` or not. The lines it
        took whole are watched; the others (returned) wait."""
        taken, refused = (lines, []) if full is None else split_at_full_queue(lines, full)
        if refused:
            self.waiting += refused
            wait_s = max(QUEUE_FULL_WAIT_S, full.reset_s) if isinstance(full, RateLimited) else QUEUE_FULL_WAIT_S
            self.retry_at = time.monotonic() + wait_s
        self._watch(taken)
        return refused

    def resumed(self, lines: list[LineJobs]) -> None:
        """Lines whose jobs an earlier run submitted: watched, not submitted again."""
        self.load += sum(self.weight(line) for line in lines)
        self.bytes += sum(line.request.jobs_bytes for line in lines)
        self._watch(lines)

    def _watch(self, lines: list[LineJobs]) -> None:
        for line in lines:
            for job_id in line.job_ids:
                self.line_of[job_id] = line
            self.watch.add(line.job_ids)

    def ended(self, results: Iterable[JobResult]) -> list[LineJobs]:
        """The lines whose every job has ended, now that `results` (from client.finished over
        `watch`) have: each with its results, ready to answer."""
        done = []
        for result in results:
            line = self.line_of.pop(result.id)
            if line.add(result):
                done.append(line)
                self.load -= self.weight(line)
                self.bytes -= line.request.jobs_bytes
        return done

    def jobs_out(self) -> list[str]:
        """The ids of the jobs submitted and not ended."""
        return list(self.line_of)

    @property
    def idle(self) -> bool:
        """Nothing submitted and not ended, nothing waiting."""
        return not self.line_of and not self.waiting
