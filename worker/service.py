"""The queue loop: read -> admit -> step -> publish -> ack, until told to stop.

One iteration reads only as many entries as the engine can take now (entries reclaimed from
dead workers first), claims them, runs one engine step, and sends the step's token events,
final results and cancel checks in one pipeline. An entry is acknowledged (and deleted) only
after its final result is in Redis: at-least-once delivery. Each claim starts a new run of the
job whose token fences off every earlier run, so a job's events and its one result come from
one run at a time; a reclaimed job continues from the tokens its event stream recorded.

Three kinds of trouble stay inside the loop. Redis unavailable (unreachable, loading, out of
memory, read-only during a failover): the engine keeps stepping, what Redis has not seen waits in
the outbox (generation pauses once it holds max_buffered_tokens), and the loop tries again with
backoff. Redis having lost the queue's consumer group (it restarted empty, or was flushed): the
loop creates the group again and adopts the jobs it holds, which run on to their results. An
engine step that raises: its jobs leave the engine and come back one per step, so the job that
makes a step fail is found and fails alone. Only errors no retry can mend (wrong credentials, an
ACL that forbids a command) stop the worker.

Every time the worker writes or compares (deadlines, timings, heartbeats) is on Redis's clock
(RedisClock): producers, workers and Redis need not agree on the time.
"""
from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import redis

from producer_client.errors import MiliError
from producer_client.keys import PROTOCOL_VERSION, Keys
from producer_client.schema import ErrorInfo, JobResult, TokenLogprob, Usage
from worker.jobs import (
    Delivery, Job, Poison, entry_time, expired_result, failed_result, parse_request, printable, prompt_token_ids,
)
from worker.metrics import WorkerMetrics
from worker.queue import (
    DeadLetter, GroupLost, Outbox, RedisClock, RedisLink, Update, WorkerQueue, is_transient,
)
from worker.replies import Adopted, ClaimOutcome, Published, PublishReply, UnknownReply, Watched
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class InternalError(MiliError):
    """A bug met while handling one job; the job fails and the worker keeps serving."""

    code = "internal_error"


class EngineError(MiliError):
    """An engine step raised, and this job was the one that made it fail."""

    code = "engine_error"


class EngineAPI(Protocol):
    """What the loop needs from an engine (worker.engine.Engine, or worker.echo_engine.EchoEngine)."""

    tokenizer: Any

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: Any, priority: int = 0,
        resume_token_ids: Sequence[int] = (),
    ) -> None: ...
    def step(self) -> list: ...
    def abort(self, request_id: str) -> bool: ...
    def capacity(self) -> Any: ...
    def has_unfinished(self) -> bool: ...
    def stats(self) -> Any: ...


class Worker:
    def __init__(
        self, engine: EngineAPI, client: redis.Redis, settings: WorkerSettings, metrics: WorkerMetrics,
        name: str, device: str = "cpu", metrics_port: int | None = None, clock: RedisClock | None = None,
    ):
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.name = name
        self.clock = clock or RedisClock()
        self.queue = WorkerQueue(client, Keys(settings.prefix), settings.queue, name, settings.result_ttl_s, self.clock)
        self.link = RedisLink(settings.redis_backoff_max_s)
        # The consumer group must be created before the next read: at start, and whenever Redis
        # has lost it (then the jobs held here are adopted too).
        self.group_missing = True
        self.jobs: dict[str, Job] = {}  # claimed and in the engine
        self.unadmitted: list[Delivery] = []  # delivered to this worker, claims not yet settled
        self.suspects: deque[Job] = deque()  # claimed, out of the engine after a failed step
        self.probe: Job | None = None  # the suspect re-added last: cleared once it produces output
        self.outbox = Outbox()  # what Redis has not seen yet
        self.acks: list[str] = []  # entries whose job is final in Redis
        self.dead_letters: list[DeadLetter] = []  # entries to move to the dead-letter stream
        self.total_pages = engine.capacity().free_pages  # the engine is empty now
        self.drain_deadline: float | None = None
        self.stop_now = False
        self.paused = False  # generation waits for the outbox to drain
        self.next_heartbeat = 0.0
        self.next_reclaim = 0.0
        # Run tokens: this process's random prefix and a count, unique across workers and claims.
        self.instance = uuid.uuid4().hex[:12]
        self.claims = itertools.count()
        self.admissions = itertools.count()  # numbers the engine request ids
        self.identity = {
            "name": name, "queue": settings.queue, "model": settings.model, "device": device,
            "host": socket.gethostname(), "pid": os.getpid(), "protocol": PROTOCOL_VERSION,
            "started_at": time.time(), "metrics_port": metrics_port or 0,
        }

    # -- lifecycle -------------------------------------------------------------------------

    def serve(self) -> None:
        log.info("serving queue %r as %s (%d KV pages)", self.settings.queue, self.name, self.total_pages)
        try:
            while self._should_run():
                self._iterate()
            self._hand_over()
        finally:
            try:
                self.queue.leave()
            except redis.RedisError as e:  # do not hide why the loop ended
                log.warning("could not remove the heartbeat: %s", e)

    def request_stop(self) -> None:
        """First call (SIGTERM): stop reading, give running jobs drain_grace_s to finish and hand
        the rest over to other workers. Second call: stop now (and still hand over)."""
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
        if not (self.engine.has_unfinished() or self.suspects or self.outbox or self.acks or self.dead_letters):
            return False
        return time.monotonic() < self.drain_deadline

    def _hand_over(self) -> None:
        """The end of a drain: publish what Redis has not seen, acknowledge, and hand the entries
        of unfinished jobs over to other workers, which resume them from their recorded tokens."""
        try:
            try:
                self._publish_and_give_back()
            except GroupLost:
                self._restore_group()  # every job held here is detached now: give them back anew
                self._publish_and_give_back()
        except redis.RedisError as e:
            if not is_transient(e):
                raise
            log.warning(
                "Redis unreachable at the end (%s): %d unfinished jobs wait claim_idle_ms to be reclaimed, and "
                "%d tokens not yet published will be generated again", e, len(self._held()), self.outbox.buffered_tokens(),
            )

    def _publish_and_give_back(self) -> None:
        if self.outbox:
            self._publish()
        self._flush_acks()
        self._give_back_unfinished()

    def _give_back_unfinished(self) -> None:
        """Held entries become claimable at once (RELEASE); detached jobs, which have no entry,
        go back to the queue as new entries (REQUEUE)."""
        held = list(self._held())
        if held:
            released = self.queue.release(held)
            log.info("handed %d unfinished jobs over to other workers", released)
        for job in self._detached():
            if self.queue.requeue(job):
                log.info("job %s: detached from its lost entry, enqueued anew for another worker", job.id)

    # -- one iteration -----------------------------------------------------------------------

    def _iterate(self) -> None:
        if self.link.ready():
            self._exchange(self._receive)
        stepped = self._step_if_possible()
        if self.link.ready() and (self.outbox or self.jobs):
            self._exchange(self._publish)
        if not stepped and not self.link.up:
            self.link.wait(self.settings.block_ms / 1000)

    def _exchange(self, talk: Callable[[], None]) -> None:
        """Run one exchange with Redis. A transient failure (connection lost, Redis loading, out
        of memory or read-only) marks the link down: everything sent is safe to send again, and
        what was not acknowledged stays in the outbox, the ack list or the pending list. A lost
        consumer group is created again before the next read, and the jobs held here adopted."""
        buffered = 0 if self.link.up else self.outbox.buffered_tokens()
        if not self.link.up:
            # Not in this exchange either, should Redis answer now: see below.
            self.next_reclaim = time.monotonic() + self.settings.claim_idle_ms / 1000
        try:
            talk()
        except GroupLost as e:
            log.warning("Redis has lost the consumer group of queue %r (%s): creating it again", self.settings.queue, e)
            self.group_missing = True
        except redis.RedisError as e:
            if not is_transient(e):
                raise
            self.link.failed(e)
            return
        down_s = self.link.succeeded()
        if down_s is not None:
            log.info("Redis is back after %.1fs; %d tokens were buffered meanwhile", down_s, buffered)
            # Entries of every worker look idle after an outage of all of them (a Redis restart):
            # reclaim nothing until the live ones have had claim_idle_ms to refresh theirs.
            self.next_reclaim = time.monotonic() + self.settings.claim_idle_ms / 1000

    def _receive(self) -> None:
        if self.group_missing:
            self._restore_group()
        self._heartbeat_if_due()
        # Entries delivered to this worker stay in `unadmitted` until their claims are settled, so
        # that an exchange failing half-way (Redis refusing the claims, a lost connection) forgets
        # none of them: they are held, refreshed, and admitted at the next try.
        self.unadmitted += self._reclaim(self._admittable())
        idle = not (self.engine.has_unfinished() or self.unadmitted or self.outbox)
        self.unadmitted += self.queue.read(
            self._admittable(), self._idle_block_ms() if idle else None, self.acks, self.dead_letters,
        )
        self.acks, self.dead_letters = [], []
        self._admit()

    def _admittable(self) -> int:
        """How many entries to take: what the engine can start now, less those taken and not yet
        admitted. Each job needs a slot and at least one page; its real page need is unknown until
        it is tokenized. None while draining, and none while suspects of a failed step are being
        tried one at a time."""
        if self.drain_deadline is not None or self.suspects or self.probe is not None:
            return 0
        cap = self.engine.capacity()
        return min(cap.free_slots, cap.free_pages) - len(self.unadmitted)

    def _idle_block_ms(self) -> int:
        until_heartbeat = int((self.next_heartbeat - time.monotonic()) * 1000)
        return max(1, min(self.settings.block_ms, until_heartbeat))

    def _flush_acks(self) -> None:
        self.queue.read(0, None, self.acks, self.dead_letters)
        self.acks, self.dead_letters = [], []

    # -- a lost consumer group ------------------------------------------------------------------

    def _restore_group(self) -> None:
        """Create the consumer group; if Redis lost it while this worker held jobs, their entries
        went with it: adopt each job (ADOPT) and run it on, detached from any entry. Nothing else
        can take such a job over, and its result reaches its producer as any other."""
        self.queue.ensure_group()
        self.unadmitted = []  # their entries are gone with the group
        holdings = self._holdings()
        if holdings:
            outcomes = self.queue.adopt(list(holdings.items()))
            for (job_id, run), outcome in zip(holdings.items(), outcomes):
                if outcome in (Adopted.ADOPTED, Adopted.RECREATED):
                    self._detach(job_id)
                    if outcome is Adopted.RECREATED:
                        self._republish_whole(job_id, run)
                else:
                    log.warning("job %s: not adopted after the group was lost (%s); this run stops", job_id, outcome)
                    self._drop(job_id)
            log.warning("%d jobs held here run on, detached from their lost entries", len(holdings))
        self.group_missing = False
        self.next_heartbeat = 0.0  # the heartbeat and the worker index may be gone as well

    def _holdings(self) -> dict[str, str]:
        """{job id: run token} of every job this worker holds."""
        held = {u.job_id: u.run for u in self.outbox.updates.values()}
        for job in [*self.jobs.values(), *self.suspects]:
            held.setdefault(job.id, job.run)
        return held

    def _republish_whole(self, job_id: str, run: str) -> None:
        """Redis lost the job's events with its hash: the next publication carries a start event
        and the whole output so far (with the final result, if it has one), so that the event
        stream is complete again for any reader, or any run that resumes the job from it."""
        old = self.outbox.updates.get(job_id)
        final = old.final if old is not None else None
        job = next((j for j in [*self.jobs.values(), *self.suspects] if j.id == job_id), None)
        if job is not None:
            ids, text, logprobs, started_at = job.token_ids, "".join(job.text), job.logprobs, job.started_at
        else:  # it ended while Redis had it still: its result holds the whole output
            ids, text, logprobs, started_at = final.token_ids, final.text, final.logprobs, final.timings.started_at
        update = Update(job_id, None, run, 0, start=start_event(self.name, started_at, 0), final=final)
        if ids or text:
            update.add_tokens(list(ids), text, logprobs)
        self.outbox.add(update)

    def _detach(self, job_id: str) -> None:
        for job in [self.jobs.get(job_id), *(j for j in self.suspects if j.id == job_id)]:
            if job is not None:
                job.entry_id = None
        update = self.outbox.updates.get(job_id)
        if update is not None:
            update.entry_id = None
            update.dead_letter = None  # no entry left to move

    def _detached(self) -> list[Job]:
        return [job for job in [*self.jobs.values(), *self.suspects] if job.entry_id is None]

    # -- reclaim --------------------------------------------------------------------------------

    def _reclaim(self, room: int) -> list[Delivery]:
        """Entries of dead or stalled workers (idle longer than claim_idle_ms), no more than room for."""
        now = time.monotonic()
        if room <= 0 or now < self.next_reclaim:
            return []
        self.next_reclaim = now + self.settings.reclaim_interval_s
        deliveries = self.queue.reclaim(room, self.settings.claim_idle_ms)
        if deliveries:
            log.info(
                "reclaimed %d entries idle over %d ms: %s", len(deliveries), self.settings.claim_idle_ms,
                ", ".join(f"{d.job_id} (delivery {d.deliveries})" for d in deliveries),
            )
        return deliveries

    # -- admit --------------------------------------------------------------------------------

    def _admit(self) -> None:
        deliveries = self.unadmitted
        if not deliveries:
            return
        now = self.clock.now()
        runs = [f"{self.instance}:{next(self.claims)}" for _ in deliveries]
        prepared = [self._job_from_entry(d, run, now) for d, run in zip(deliveries, runs)]
        resumed: list[tuple[Delivery, Job]] = []
        claims = self.queue.claim([(d.job_id, d.entry_id, run) for d, run in zip(deliveries, runs)])
        self.unadmitted = []
        for d, run, job, claim in zip(deliveries, runs, prepared, claims):
            if isinstance(claim, Exception):
                log.error("job %s: Redis refused its claim (%s); dead-lettering entry %s", d.job_id, claim, d.entry_id)
                self.dead_letters.append(DeadLetter(d.entry_id, d.fields, f"claim refused: {claim}", d.deliveries))
                continue
            if claim.outcome is ClaimOutcome.CLAIMED and (d.job_id in self.jobs or any(j.id == d.job_id for j in self.suspects)):
                self._drop(d.job_id)  # its own entry, reclaimed after a stall: the claim fenced the old run
            if claim.outcome is not ClaimOutcome.CLAIMED:
                log.info("dropping entry %s of job %s: %s", d.entry_id, d.job_id, claim.outcome.value)
                self.acks.append(d.entry_id)
            elif d.deliveries > self.settings.max_deliveries:
                self._dead_letter_poison(d, run, claim.recorded_tokens)
            elif isinstance(job, MiliError):
                log.info("job %s failed before it started: %s: %s", d.job_id, job.code, job.message)
                final = failed_result(d.job_id, d.entry_id, job, self.name, now)
                self.outbox.add(Update(d.job_id, d.entry_id, run, claim.recorded_tokens, final=final))
            else:
                if claim.deadline is not None:
                    job.deadline = claim.deadline
                if claim.recorded_tokens:
                    resumed.append((d, job))
                else:
                    self._start_unless_expired(job)
        if resumed:
            self._resume_all(resumed)

    def _resume_all(self, resumed: list[tuple[Delivery, Job]]) -> None:
        try:
            events = self.queue.recorded_events([job.id for _, job in resumed])
        except redis.RedisError:
            self.unadmitted += [d for d, _ in resumed]  # claimed again at the next try, with a new run
            raise
        for _, job in resumed:
            self._resume(job, events[job.id])

    def _job_from_entry(self, d: Delivery, run: str, now: float) -> Job | MiliError:
        try:
            request = parse_request(d.fields, self.settings.max_body_bytes, self.settings.max_tokens_limit)
            ids = prompt_token_ids(request, self.engine.tokenizer)
        except MiliError as e:
            return e
        except Exception as e:  # a bug must cost one job, not the worker
            log.exception("job %s: unexpected error while reading its entry", d.job_id)
            return InternalError(f"{type(e).__name__}: {e}")
        return Job(d.job_id, d.entry_id, run, request, ids, queued_at=entry_time(d.entry_id), started_at=now)

    def _dead_letter_poison(self, d: Delivery, run: str, recorded_tokens: int) -> None:
        error = Poison(
            f"delivered {d.deliveries} times, more than max_deliveries {self.settings.max_deliveries}: "
            "every worker that took it stopped before finishing it"
        )
        log.warning("job %s: %s; moving entry %s to the dead-letter stream", d.job_id, error.message, d.entry_id)
        letter = DeadLetter(d.entry_id, d.fields, error.message, d.deliveries)
        final = failed_result(d.job_id, d.entry_id, error, self.name, self.clock.now())
        self.outbox.add(Update(d.job_id, d.entry_id, run, recorded_tokens, final=final, dead_letter=letter))

    def _resume(self, job: Job, events: list[tuple[str, dict[str, str]]]) -> None:
        try:
            job.resume(events)
        except Exception as e:  # events this worker cannot read: fail the job, not the worker
            log.exception("job %s: its recorded events cannot be read", job.id)
            self._end_unstarted(job, job.result("failed", "error", job.usage(), self.name, self.clock.now(), error_info(
                InternalError(f"its recorded events cannot be read: {type(e).__name__}: {e}"))))
            return
        log.info("job %s: resuming after %d recorded tokens", job.id, job.resumed_tokens)
        self._start_unless_expired(job)

    def _start_unless_expired(self, job: Job) -> None:
        now = self.clock.now()
        if job.deadline is not None and now > job.deadline:
            # Never started: expired. Started by an earlier run: it ends now, with what it made.
            final = job.result("done", "timeout", job.usage(), self.name, now) if job.token_ids else expired_result(
                job.id, job.entry_id, self.name, now
            )
            self._end_unstarted(job, final)
            return
        update = self.outbox.for_job(job)
        if self._add_to_engine(job, update):
            update.start = start_event(self.name, now, job.resumed_tokens)

    def _end_unstarted(self, job: Job, final: JobResult) -> None:
        self.outbox.for_job(job).final = final

    def _add_to_engine(self, job: Job, update: Update) -> bool:
        """Hand the job to the engine, continuing after its tokens so far; a job the engine
        refuses ends failed. Returns whether it is in the engine. Each admission gets a request id
        of its own: the final output of an aborted earlier one (after a failed step, or a run this
        worker lost and took back) must not be taken for this one's. `#` never occurs in job ids."""
        job.engine_id = f"{job.id}#{next(self.admissions)}"
        try:
            self.engine.add_request(
                job.engine_id, job.prompt_token_ids, job.request.params, job.request.priority,
                resume_token_ids=job.token_ids,
            )
        except Exception as e:
            if not isinstance(e, MiliError):
                log.exception("job %s: the engine's add_request raised", job.id)
                e = InternalError(f"{type(e).__name__}: {e}")
            log.info("job %s rejected by the engine: %s: %s", job.id, e.code, e.message)
            update.final = job.result("failed", "error", job.usage(), self.name, self.clock.now(), error_info(e))
            return False
        self.jobs[job.id] = job
        return True

    # -- step ---------------------------------------------------------------------------------

    def _step_if_possible(self) -> bool:
        """One engine step, unless the engine has nothing to do or the outbox is full (Redis has
        been unreachable for a while: generation waits, the jobs stay in the engine)."""
        if self.outbox.buffered_tokens() >= self.settings.max_buffered_tokens:
            if not self.paused:
                log.warning("%d tokens await publication: generation pauses until Redis is back", self.outbox.buffered_tokens())
            self.paused = True
            return False
        self.paused = False
        self._try_next_suspect()
        if not self.engine.has_unfinished():
            return False
        self._stop_overdue()
        self._collect(self._step())
        return True

    def _stop_overdue(self) -> None:
        now = self.clock.now()
        for job in list(self.jobs.values()):
            if job.stop_reason is None and job.deadline is not None and now > job.deadline:
                self._stop(job, "timeout")

    def _stop(self, job: Job, reason: str) -> None:
        """Abort in the engine; its final output (finish_reason "abort") comes with the next step."""
        job.stop_reason = reason
        self._abort(job)

    def _abort(self, job: Job) -> None:
        try:
            self.engine.abort(job.engine_id)
        except Exception:
            log.exception("job %s: the engine's abort raised", job.id)

    def _step(self) -> list:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("an engine step of %d jobs failed", len(self.jobs))
            self._isolate_failure(EngineError(f"{type(e).__name__}: {e}"))
            return []
        return outputs

    def _isolate_failure(self, error: EngineError) -> None:
        """Take every job out of the engine. The one that failed a step alone, or the suspect
        re-added last that has produced nothing since, fails; the rest become suspects, re-added
        one at a time from their tokens so far (KV pages of aborted jobs stay in the prefix
        cache, so that is cheap), each once the one before has produced output. A fault tied to
        a job's next position shows at its first step back, so it names its job; the others
        lose no tokens."""
        live = list(self.jobs.values())
        culprit = self.probe if self.probe is not None and self.probe.id in self.jobs else None
        if culprit is None and len(live) == 1:
            culprit = live[0]
        self.probe = None
        for job in live:
            del self.jobs[job.id]
            self._abort(job)
            if job is culprit:
                log.warning("job %s fails: an engine step failed with it: %s", job.id, error.message)
                final = job.result("failed", "error", job.usage(), self.name, self.clock.now(), error_info(error))
                self.outbox.for_job(job).final = final
            else:
                self.suspects.append(job)
        if self.suspects:
            log.warning("re-adding %d jobs one per step to find the one that makes steps fail", len(self.suspects))

    def _try_next_suspect(self) -> None:
        if self.probe is not None or not self.suspects:
            return
        job = self.suspects.popleft()
        now = self.clock.now()
        if job.deadline is not None and now > job.deadline:
            self._end_unstarted(job, job.result("done", "timeout", job.usage(), self.name, now))
            return
        if self._add_to_engine(job, self.outbox.for_job(job)):
            self.probe = job

    def _collect(self, outputs: list) -> None:
        now = self.clock.now()
        for out in outputs:
            job = self.jobs.get(out.request_id.rpartition("#")[0])
            if job is None or out.request_id != job.engine_id:
                continue  # an aborted admission's last word
            if job is self.probe:
                self.probe = None
            update = self.outbox.for_job(job)
            if out.new_token_ids or out.text_delta:
                self._record_delta(job, update, out, now)
            if out.finished:
                del self.jobs[job.id]
                update.final = self._final_result(job, out, now)

    def _record_delta(self, job: Job, update: Update, out, now: float) -> None:
        if job.first_token_at is None and out.new_token_ids:
            job.first_token_at = now
        logprobs = None
        if out.logprobs is not None:
            logprobs = [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top)) for lp in out.logprobs]
            job.logprobs = (job.logprobs or []) + logprobs
        update.add_tokens(out.new_token_ids, out.text_delta, logprobs)
        job.token_ids.extend(out.new_token_ids)
        job.text.append(out.text_delta)
        self.metrics.generation_tokens.inc(len(out.new_token_ids))

    def _final_result(self, job: Job, out, now: float) -> JobResult:
        u = out.usage
        usage = Usage(
            prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
            cached_prompt_tokens=u.cached_prompt_tokens,
        )
        if out.finish_reason == "abort":
            if job.stop_reason == "timeout":
                return job.result("done", "timeout", usage, self.name, now)
            return job.result("cancelled", "abort", usage, self.name, now)
        if out.error is not None:
            error = ErrorInfo(code=out.error.code, message=out.error.message)
            return job.result("failed", "error", usage, self.name, now, error)
        return job.result("done", out.finish_reason, usage, self.name, now)

    # -- publish --------------------------------------------------------------------------------

    def _publish(self) -> None:
        updates = list(self.outbox.updates.values())
        watch = [
            (job.id, job.run) for job in self.jobs.values()
            if job.stop_reason is None and job.id not in self.outbox.updates
        ]
        if not (updates or watch):
            return
        published, watched = self.queue.publish(updates, watch)
        refused: Exception | None = None  # a transient refusal: those updates stay, the link backs off
        gone: list[str] = []  # jobs whose hash Redis no longer has
        for update, reply in zip(updates, published):
            if isinstance(reply, Exception) and is_transient(reply):
                refused = refused or reply
            elif isinstance(reply, PublishReply) and reply.outcome is Published.GONE:
                gone.append(update.job_id)
            else:
                self.outbox.discard(update.job_id)
                self._settle(update, reply)
        for (job_id, _), state in zip(watch, watched):
            if isinstance(state, Exception) and is_transient(state):
                refused = refused or state
            elif state is Watched.GONE:
                gone.append(job_id)
            else:
                self._react(job_id, state)
        if refused is not None:
            raise refused
        if gone:
            self._account_for_gone(gone)

    def _account_for_gone(self, job_ids: list[str]) -> None:
        """Jobs whose hash Redis no longer has. If the queue's group is gone too, Redis lost its
        data: the jobs (their updates kept) are adopted before the next read. Otherwise their keys
        were deleted by hand, and they stop here."""
        if not self.queue.group_exists():
            raise GroupLost(f"the hashes of {len(job_ids)} running jobs and the group are gone")
        for job_id in job_ids:
            log.warning("job %s: its keys were deleted while it ran; this run stops", job_id)
            self._drop(job_id)

    def _settle(self, update: Update, reply: PublishReply | Exception) -> None:
        if isinstance(reply, UnknownReply):
            self._fail_on_unknown_reply(update, reply)
        elif isinstance(reply, Exception):
            # The job's keys refused PUBLISH (a key of the wrong type): its entry stays pending,
            # and the claim that follows a reclaim dead-letters it with the reason.
            log.error("job %s: Redis refused its update: %s", update.job_id, reply)
            self._drop(update.job_id)
        elif reply.outcome is Published.PARTIAL and update.skip_recorded(reply.recorded):
            self.outbox.add(update)  # the rest goes with the next publication
        elif reply.outcome in (Published.LOST, Published.PARTIAL):
            log.warning("job %s: another worker has taken it over; this run stops", update.job_id)
            self._drop(update.job_id)
        elif reply.outcome in (Published.WRITTEN, Published.ENDED):
            self._drop(update.job_id)  # ended elsewhere while it ran here: a result exists
            if update.dead_letter is not None:
                self.dead_letters.append(update.dead_letter)
            elif update.entry_id is not None:
                self.acks.append(update.entry_id)
            if reply.outcome is Published.WRITTEN and update.final is not None:
                self._count_end(update)
        elif reply.outcome is Published.CANCEL:
            self._react(update.job_id, Watched.CANCEL)

    def _fail_on_unknown_reply(self, update: Update, error: UnknownReply) -> None:
        """The job fails with internal_error, its tokens kept for the result; if even its final
        update gets an answer PUBLISH does not give, the job is dropped, its entry left pending."""
        log.error("job %s: %s", update.job_id, error)
        job = self.jobs.pop(update.job_id, None)
        if update.final is not None or job is None:
            self._drop(update.job_id)
            return
        self._abort(job)
        update.final = job.result(
            "failed", "error", job.usage(), self.name, self.clock.now(), error_info(InternalError(str(error)))
        )
        self.outbox.add(update)

    def _react(self, job_id: str, state: Watched | Exception) -> None:
        if isinstance(state, Exception) or state is Watched.LOST:
            reason = f"its keys refused a read: {state}" if isinstance(state, Exception) else "another worker has taken it over"
            log.warning("job %s: %s; this run stops", job_id, reason)
            self._drop(job_id)
            return
        job = self.jobs.get(job_id)
        if state is Watched.CANCEL and job is not None and job.stop_reason is None:
            log.info("job %s cancelled while running", job_id)
            self._stop(job, "cancel")

    def _drop(self, job_id: str) -> None:
        """Forget a job without acknowledging its entry: it is someone else's now, or final."""
        job = self.jobs.pop(job_id, None)
        if job is not None:
            self._abort(job)
        if self.suspects:
            self.suspects = deque(j for j in self.suspects if j.id != job_id)
        self.unadmitted = [d for d in self.unadmitted if d.job_id != job_id]
        self.outbox.discard(job_id)

    def _count_end(self, update: Update) -> None:
        if update.dead_letter is not None:
            self.metrics.jobs.labels("dead_lettered").inc()
        else:
            self.metrics.job_ended(update.final)
        log_end(update.final)

    # -- heartbeat and ownership -------------------------------------------------------------------

    def _held(self) -> dict[str, str]:
        """{entry id: job id} of the entries this worker holds: delivered and not yet admitted, jobs in
        the engine, suspects, and updates not yet published (a job that ended while Redis was away
        is still pending). Detached jobs have none."""
        held = {d.entry_id: d.job_id for d in self.unadmitted}
        held.update((u.entry_id, u.job_id) for u in self.outbox.updates.values() if u.entry_id is not None)
        held.update((job.entry_id, job.id) for job in [*self.jobs.values(), *self.suspects] if job.entry_id is not None)
        return held

    def _heartbeat_if_due(self) -> None:
        now = time.monotonic()
        if now < self.next_heartbeat:
            return
        cap = self.engine.capacity()
        started = sum(1 for j in self.jobs.values() if j.first_token_at is not None)
        fields = {
            **self.identity,
            "state": "serving" if self.drain_deadline is None else "draining",
            "running": len(self.jobs) + len(self.suspects), "free_slots": cap.free_slots, "free_pages": cap.free_pages,
            "total_pages": self.total_pages, "page_size": cap.page_size,
        }
        held = self._held()
        depth, lost = self.queue.heartbeat(fields, self.settings.heartbeat_ttl_s, list(held))
        self.next_heartbeat = now + self.settings.heartbeat_interval_s
        for entry_id in lost:
            log.warning("job %s: its entry %s was reclaimed by another worker; this run stops", held[entry_id], entry_id)
            self._drop(held[entry_id])
        m = self.metrics
        m.queue_depth.set(depth)
        m.requests_running.set(started)
        m.requests_waiting.set(len(self.jobs) - started)
        m.kv_cache_usage.set(1 - cap.free_pages / self.total_pages if self.total_pages else 0.0)
        stats = self.engine.stats()
        m.engine_totals(stats.cache_queried_tokens, stats.cache_hit_tokens, stats.preemptions)


def start_event(worker: str, started_at: float, resumed_tokens: int) -> str:
    """A run's `start` event: who runs the job, since when, after how many recorded tokens."""
    return json.dumps({"worker": worker, "started_at": started_at, "resumed_tokens": resumed_tokens})


def error_info(error: MiliError) -> ErrorInfo:
    return ErrorInfo(code=error.code, message=printable(error.message))


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
