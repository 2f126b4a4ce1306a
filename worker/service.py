"""The queue loop: read -> admit -> step -> publish -> ack, until told to stop.

One iteration reads only as many entries as the engine can take now (so waiting jobs stay
in the shared stream for any idle worker), claims them, runs one engine step, and sends the
step's token events, final results and cancel checks in one pipeline. An entry is
acknowledged (and deleted) only after its final result is in Redis: at-least-once delivery.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any, Protocol

import redis

from producer_client.errors import MiliError
from producer_client.keys import PROTOCOL_VERSION, Keys
from producer_client.schema import ErrorInfo, JobResult, TokenLogprob, Usage
from worker.jobs import (
    Job, entry_time, expired_result, failed_result, job_id_of, parse_request, prompt_token_ids, token_event,
)
from worker.metrics import WorkerMetrics
from worker.queue import Batch, WorkerQueue
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class InternalError(MiliError):
    """A bug met while handling one job; the job fails and the worker keeps serving."""

    code = "internal_error"


class EngineError(MiliError):
    """The engine step raised; the jobs in that step fail."""

    code = "engine_error"


class EngineAPI(Protocol):
    """What the loop needs from an engine (worker.engine.Engine, or worker.echo_engine.EchoEngine)."""

    tokenizer: Any

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any, priority: int = 0) -> None: ...
    def step(self) -> list: ...
    def abort(self, request_id: str) -> bool: ...
    def capacity(self) -> Any: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> Any: ...


class Worker:
    def __init__(
        self, engine: EngineAPI, client: redis.Redis, settings: WorkerSettings, metrics: WorkerMetrics,
        name: str, device: str = "cpu", metrics_port: int | None = None,
    ):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.name = name
        self.queue = WorkerQueue(client, Keys(settings.prefix), settings.queue, name, settings.result_ttl_s)
        self.jobs: dict[str, Job] = {}  # claimed and in the engine
        self.acks: list[str] = []  # entries whose job is final in Redis
        self.total_pages = engine.capacity().free_pages  # the engine is empty now
        self.drain_deadline: float | None = None
        self.stop_now = False
        self.next_heartbeat = 0.0
        self.identity = {
            "name": name, "queue": settings.queue, "model": settings.model, "device": device,
            "host": socket.gethostname(), "pid": os.getpid(), "protocol": PROTOCOL_VERSION,
            "started_at": time.time(), "metrics_port": metrics_port or 0,
        }

    # -- lifecycle -------------------------------------------------------------------------

    def serve(self) -> None:
        self.queue.ensure_group()
        log.info("serving queue %r as %s (%d KV pages)", self.settings.queue, self.name, self.total_pages)
        try:
            while self._should_run():
                self._iterate()
            self.queue.read(0, None, self._take_acks())
        finally:
            try:
                self.queue.leave()
            except redis.RedisError as e:  # do not hide why the loop ended
                log.warning("could not remove the heartbeat: %s", e)
            if self.jobs:
                log.warning("left %d unfinished jobs pending for other workers: %s", len(self.jobs), list(self.jobs))

    def request_stop(self) -> None:
        """First call (SIGTERM): stop reading, give running jobs drain_grace_s to finish and
        leave the rest pending, unacknowledged, for other workers. Second call: stop now."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.settings.drain_grace_s
            log.info("draining: %d running jobs, %.0fs grace", len(self.jobs), self.settings.drain_grace_s)
        else:
            self.stop_now = True

    def _should_run(self) -> bool:
        if self.stop_now:
            return False
        if self.drain_deadline is None:
            return True
        if not self.engine.has_unfinished():
            return False
        return time.monotonic() < self.drain_deadline

    # -- one iteration -----------------------------------------------------------------------

    def _iterate(self) -> None:
        self._heartbeat_if_due()
        batch = Batch()
        self._admit(self._read(), batch)
        if self.engine.has_unfinished():
            self._stop_overdue()
            self._collect(self._step(batch), batch)
        self._publish(batch)

    def _read(self) -> list[tuple[str, dict[str, str]]]:
        busy = self.engine.has_unfinished()
        return self.queue.read(self._admittable(), None if busy else self._idle_block_ms(), self._take_acks())

    def _admittable(self) -> int:
        """How many entries to read: what the engine can start now. Each job needs a slot
        and at least one page; its real page need is unknown until it is tokenized."""
        if self.drain_deadline is not None:
            return 0
        cap = self.engine.capacity()
        return min(cap.free_slots, cap.free_pages)

    def _idle_block_ms(self) -> int:
        until_heartbeat = int((self.next_heartbeat - time.monotonic()) * 1000)
        return max(1, min(self.settings.block_ms, until_heartbeat))

    def _take_acks(self) -> list[str]:
        acks, self.acks = self.acks, []
        return acks

    # -- admit --------------------------------------------------------------------------------

    def _admit(self, entries: list[tuple[str, dict[str, str]]], batch: Batch) -> None:
        if not entries:
            return
        now = time.time()
        runnable: list[Job] = []
        for entry_id, fields in entries:
            job_id = job_id_of(entry_id, fields)
            try:
                job = self._job_from_entry(job_id, entry_id, fields, now)
            except MiliError as e:
                log.info("job %s failed before it started: %s: %s", job_id, e.code, e.message)
                batch.update(job_id, entry_id).final = failed_result(job_id, entry_id, e, self.name)
                continue
            if job.deadline is not None and now > job.deadline:
                batch.update(job_id, entry_id).final = expired_result(job_id, entry_id, self.name)
            else:
                runnable.append(job)
        if not runnable:
            return
        for job, outcome in zip(runnable, self.queue.claim([(j.id, j.entry_id) for j in runnable])):
            if outcome == "claimed":
                self._start(job, batch)
            else:
                log.info("dropping entry %s of job %s: %s", job.entry_id, job.id, outcome)
                self.acks.append(job.entry_id)

    def _job_from_entry(self, job_id: str, entry_id: str, fields: dict[str, str], now: float) -> Job:
        try:
            request = parse_request(fields, self.settings.max_body_bytes, self.settings.max_tokens_limit)
            ids = prompt_token_ids(request, self.engine.tokenizer)
        except MiliError:
            raise
        except Exception as e:  # a bug must cost one job, not the worker
            log.exception("job %s: unexpected error while reading its entry", job_id)
            raise InternalError(f"{type(e).__name__}: {e}") from e
        return Job(job_id, entry_id, request, ids, queued_at=entry_time(entry_id), started_at=now)

    def _start(self, job: Job, batch: Batch) -> None:
        update = batch.update(job.id, job.entry_id)
        try:
            self.engine.add_request(job.id, job.prompt_token_ids, job.request.params, job.request.priority)
        except MiliError as e:
            log.info("job %s rejected by the engine: %s: %s", job.id, e.code, e.message)
            usage = Usage(prompt_tokens=len(job.prompt_token_ids))
            update.final = job.result("failed", "error", usage, self.name, ErrorInfo(code=e.code, message=e.message))
            return
        self.jobs[job.id] = job
        update.start = json.dumps({"worker": self.name, "started_at": job.started_at})

    # -- step ---------------------------------------------------------------------------------

    def _stop_overdue(self) -> None:
        now = time.time()
        for job in list(self.jobs.values()):
            if job.stop_reason is None and job.deadline is not None and now > job.deadline:
                self._stop(job, "timeout")

    def _stop(self, job: Job, reason: str) -> None:
        """Abort in the engine; its final output (finish_reason "abort") comes with the next step."""
        job.stop_reason = reason
        self.engine.abort(job.id)

    def _step(self, batch: Batch) -> list:
        try:
            return self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing its %d jobs", len(self.jobs))
            self._fail_all(EngineError(f"{type(e).__name__}: {e}"), batch)
            return []

    def _fail_all(self, error: MiliError, batch: Batch) -> None:
        info = ErrorInfo(code=error.code, message=error.message)
        for job in list(self.jobs.values()):
            del self.jobs[job.id]
            try:
                self.engine.abort(job.id)
            except Exception:
                log.exception("job %s: abort after the failed step failed too", job.id)
            usage = Usage(prompt_tokens=len(job.prompt_token_ids), completion_tokens=len(job.token_ids))
            update = batch.update(job.id, job.entry_id)
            update.final = job.result("failed", "error", usage, self.name, info)
            update.tokens_so_far = len(job.token_ids)

    def _collect(self, outputs: list, batch: Batch) -> None:
        now = time.time()
        for out in outputs:
            job = self.jobs.get(out.request_id)
            if job is None:
                continue
            update = batch.update(job.id, job.entry_id)
            if out.new_token_ids or out.text_delta:
                update.tokens = self._record_delta(job, out, now)
            update.tokens_so_far = len(job.token_ids)
            if out.finished:
                del self.jobs[job.id]
                update.final = self._final_result(job, out)

    def _record_delta(self, job: Job, out, now: float) -> str:
        """Add the output's delta to the job; returns its tokens event."""
        if job.first_token_at is None and out.new_token_ids:
            job.first_token_at = now
        job.token_ids.extend(out.new_token_ids)
        job.text.append(out.text_delta)
        logprobs = None
        if out.logprobs is not None:
            logprobs = [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top)) for lp in out.logprobs]
            job.logprobs = (job.logprobs or []) + logprobs
        self.metrics.generation_tokens.inc(len(out.new_token_ids))
        return token_event(out.new_token_ids, out.text_delta, logprobs)

    def _final_result(self, job: Job, out) -> JobResult:
        u = out.usage
        usage = Usage(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
            cached_prompt_tokens=u.cached_prompt_tokens,
        )
        if out.finish_reason == "abort":
            if job.stop_reason == "timeout":
                return job.result("done", "timeout", usage, self.name)
            return job.result("cancelled", "abort", usage, self.name)
        if out.error is not None:
            error = ErrorInfo(code=out.error.code, message=out.error.message)
            return job.result("failed", "error", usage, self.name, error)
        return job.result("done", out.finish_reason, usage, self.name)

    # -- publish --------------------------------------------------------------------------------

    def _publish(self, batch: Batch) -> None:
        batch.watch = [
            job_id for job_id, job in self.jobs.items() if job.stop_reason is None and job_id not in batch.updates
        ]
        if not (batch.updates or batch.watch):
            return
        published = self.queue.publish(batch)
        for update, written in published.finished:
            self.acks.append(update.entry_id)
            if written:
                self.metrics.job_ended(update.final)
                log_end(update.final)
        for job_id in published.stop:
            job = self.jobs.get(job_id)
            if job is not None and job.stop_reason is None:
                log.info("job %s cancelled while running", job_id)
                self._stop(job, "cancel")

    # -- heartbeat --------------------------------------------------------------------------------

    def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now < self.next_heartbeat:
            return
        self.next_heartbeat = now + self.settings.heartbeat_interval_s
        cap = self.engine.capacity()
        started = sum(1 for j in self.jobs.values() if j.first_token_at is not None)
        fields = {
            **self.identity,
            "state": "serving" if self.drain_deadline is None else "draining",
            "running": len(self.jobs), "free_slots": cap.free_slots, "free_pages": cap.free_pages,
            "total_pages": self.total_pages, "page_size": cap.page_size, "updated_at": time.time(),
        }
        depth = self.queue.heartbeat(fields, self.settings.heartbeat_ttl_s)
        m = self.metrics
        m.queue_depth.set(depth)
        m.requests_running.set(started)
        m.requests_waiting.set(len(self.jobs) - started)
        m.kv_cache_usage.set(1 - cap.free_pages / self.total_pages if self.total_pages else 0.0)
        stats = self.engine.stats()
        m.engine_totals(stats.cache_queried_tokens, stats.cache_hit_tokens, stats.preemptions)


def log_end(result: JobResult) -> None:
    t, u = result.timings, result.usage
    log.info(
        "job %s %s (%s): %d prompt tokens (%d cached), %d output tokens; queue %s ttft %s e2e %s%s",
        result.id, result.status, result.finish_reason, u.prompt_tokens, u.cached_prompt_tokens,
        u.completion_tokens, _secs(t.queue_s), _secs(t.ttft_s), _secs(t.e2e_s),
        f"; {result.error.code}: {result.error.message}" if result.error else "",
    )


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
