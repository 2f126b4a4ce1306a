"""How an entry becomes a running job: taken (read, or reclaimed from a dead or stalled worker),
claimed (a new run fences off every earlier one), then started in the engine, resumed after
the tokens earlier runs recorded, expired, failed with its error code, or dead-lettered."""

from __future__ import annotations

import itertools
import logging
import time
import uuid

import redis

from producer_client.errors import MiliError
from producer_client.keys import LANES
from producer_client.protocol.clock import entry_time
from producer_client.protocol.events import encode_start
from producer_client.protocol.execution import AddCommands
from producer_client.protocol.replies import ClaimOutcome
from worker.loop.context import LoopContext
from worker.loop.intake import Delivery, job_from_entry
from worker.loop.jobs import AdmissionId, InternalError, InvalidJob, Job, Poison, final_result
from worker.loop.queue import HANDED_OVER_MIN_IDLE_MS
from worker.loop.rejection import Rejections

log = logging.getLogger(__name__)

FLEX = LANES[2]


class Admission:
    def __init__(self, ctx: LoopContext, rejections: Rejections):
        self.queue, self.job_commands, self.engine, self.holdings = (
            ctx.queue,
            ctx.job_commands,
            ctx.engine,
            ctx.holdings,
        )
        self.settings, self.clock, self.worker = ctx.settings, ctx.clock, ctx.worker
        self.rejections = rejections
        self.next_reclaim = 0.0
        # Until then, only entries a drain handed over are taken (see reclaim).
        self.takes_idle_entries_from = time.monotonic() + ctx.settings.claim_idle_ms / 1000
        # Run tokens: this process's random prefix and a count, unique across workers and claims.
        self.instance = uuid.uuid4().hex[:12]
        self.claims = itertools.count()
        self.admissions = itertools.count()  # numbers the engine request ids

    def room(self) -> int:
        """How many entries to take: what the engine can start now, less those taken and not yet
        admitted, and those of ended jobs whose result Redis has not confirmed yet (their entries
        are pending until then, and pending entries stay within the engine's slots). Each job needs
        a slot and at least one page; its real page need is unknown until it is tokenized."""
        cap = self.engine.capacity()
        return min(cap.free_slots, cap.free_pages) - len(self.holdings.unadmitted) - self.holdings.ended()

    def rooms(self) -> tuple[int, int, int]:
        """Room for each lane, in LANES order: how many entries of that lane (or a higher one) to
        take. The lowest lane's is room(); a higher lane's counts the jobs held of lower lanes as
        room too, since the engine preempts them for it (worker/engine: lanes): the engine's slots
        less the jobs held of that lane and higher ones, and those of that lane and higher ones
        that ended and whose entry is still pending. So a lane's pending entries and its higher
        lanes' stay within the slots, and flex jobs that ended, which hold no engine slot, never
        keep a default job out while Redis has not yet taken their results."""
        flex = self.room()
        # The running jobs' lanes as Holdings counts them when jobs start and leave (asked every
        # iteration, where up to max_running of them run); the few others' (suspects, entries not
        # yet admitted, ended jobs whose entry is pending) counted here by list.count, in C.
        holdings = self.holdings
        running = holdings.running_lanes
        lanes = [job.route.lane for job in holdings.suspects]
        lanes += [d.route.lane for d in holdings.unadmitted]
        lanes += holdings.ended_lanes()
        priority = running.get("priority", 0) + lanes.count("priority")
        slots = self.settings.engine.max_running
        default = max(flex, slots - priority - running.get("default", 0) - lanes.count("default"))
        return max(default, slots - priority), default, flex

    def defer_reclaims(self) -> None:
        """Take no idle entry for claim_idle_ms: Redis was out of reach, so every live worker's
        entries may look idle until it has refreshed them."""
        self.takes_idle_entries_from = time.monotonic() + self.settings.claim_idle_ms / 1000

    def reclaim(self, room: int) -> None:
        """Take entries of dead or stalled workers (idle longer than claim_idle_ms), no more than
        room for. Taken entries are held until admitted, so a failed exchange forgets none.

        For claim_idle_ms after this worker starts, and after each outage it lived through, it
        takes only entries a drain handed over: after a Redis restart or failover every entry
        looks idle for as long as the outage lasted (and as long as Redis took to load its data),
        and the live workers need that time to reconnect and refresh theirs. A worker that
        started meanwhile saw no outage, so its own start is what it counts from."""
        now = time.monotonic()
        if room <= 0 or now < self.next_reclaim:
            return
        self.next_reclaim = now + self.settings.reclaim_interval_s
        min_idle_ms = self.min_idle_ms()
        deliveries = self.queue.reclaims.reclaim(room, min_idle_ms)
        log_reclaimed(deliveries, min_idle_ms)
        self.holdings.take(deliveries)

    def min_idle_ms(self) -> int:
        """How long an entry must have gone unrefreshed for this worker to take it now."""
        if time.monotonic() < self.takes_idle_entries_from:
            return HANDED_OVER_MIN_IDLE_MS
        return self.settings.claim_idle_ms

    def admit(self, look: AddCommands | None = None) -> bool:
        """Claim every entry taken and not yet admitted, and act on each claim's outcome. If the
        claims fail (Redis refuses them, the connection breaks), the entries stay held for the
        next try. `look` (QueueReads.higher_lanes_look): sent with the claims when every entry is
        flex; returns whether it found a job waiting in a higher lane."""
        deliveries = self.holdings.unadmitted
        if not deliveries:
            return False
        now = self.clock.now()
        runs = [f"{self.instance}:{next(self.claims)}" for _ in deliveries]
        prepared = [
            job_from_entry(d, run, now, self.settings, self.engine.tokenizer) for d, run in zip(deliveries, runs)
        ]
        jobs = [(d.job_id, d.entry_id, run) for d, run in zip(deliveries, runs)]
        found = False
        if look is not None and all(d.route.lane == FLEX for d in deliveries):
            claims, looked = self.job_commands.claim_and_look(jobs, look)
            found = isinstance(looked, int) and looked > 0
        else:
            claims = self.job_commands.claim(jobs)
        self.holdings.claims_answered()
        resumed: list[tuple[Delivery, str, Job, int]] = []
        for d, run, job, claim in zip(deliveries, runs, prepared, claims):
            if isinstance(claim, Exception):
                self.rejections.of_delivery(d, claim)
                continue
            if claim.outcome is ClaimOutcome.CLAIMED and self.holdings.find(d.job_id) is not None:
                self.holdings.drop(d.job_id)  # its own entry, reclaimed after a stall: the claim fenced the old run
            if claim.outcome is not ClaimOutcome.CLAIMED:
                log.info("dropping entry %s of job %s: %s", d.entry_id, d.job_id, claim.outcome.value)
                self.holdings.ack_duplicate(d)
            elif d.deliveries > self.settings.max_deliveries and not (claim.recorded_tokens and isinstance(job, Job)):
                self._dead_letter_poison(d, run, claim.recorded_tokens)
            elif isinstance(job, MiliError):
                log.info("job %s failed before it started: %s: %s", d.job_id, job.code, job.message)
                final = final_result(d.job_id, "failed", "error", self.worker, now, entry_time(d.entry_id), error=job)
                self.holdings.end_delivery(d, run, claim.recorded_tokens, final)
            else:
                if claim.deadline is not None:
                    job.deadline = claim.deadline
                if claim.recorded_tokens:  # (a poison one too: it ends with what earlier runs made)
                    resumed.append((d, run, job, claim.recorded_tokens))
                else:
                    self.start_unless_expired(job)
        if resumed:
            self._resume_all(resumed)
        return found

    def add_to_engine(self, job: Job, start_event: str = "") -> bool:
        """Hand the job to the engine, continuing after its tokens so far (`start_event`: its run's
        start, for a run's first admission); a job the engine refuses ends failed. Returns whether
        it is in the engine."""
        job.engine_id = AdmissionId(job.id, next(self.admissions))
        try:
            self.engine.add_request(
                job.engine_id,
                job.prompt_token_ids,
                job.request.params,
                job.request.priority,
                resume_token_ids=job.token_ids,
                constraint=job.constraint,
                adapter=job.request.adapter,
                lane=LANES.index(job.route.lane),
            )
        except Exception as e:
            if not isinstance(e, MiliError):
                log.exception("job %s: the engine's add_request raised", job.id)
                e = InternalError(f"{type(e).__name__}: {e}")
            log.info("job %s rejected by the engine: %s: %s", job.id, e.code, e.message)
            self.holdings.end(job, job.result("failed", "error", self.worker, self.clock.now(), error=e))
            return False
        self.holdings.start(job, start_event)
        return True

    def start_unless_expired(self, job: Job) -> None:
        now = self.clock.now()
        if job.called_before:  # its one tool call is made: it ended then (tool_calls), whoever ends it now
            self.holdings.end(job, job.result("done", "stop", self.worker, now))
            return
        if job.deadline is not None and now > job.deadline:
            # Never started: expired. Started by an earlier run: it ends now, with what it made.
            if job.token_ids:
                final = job.result("done", "timeout", self.worker, now)
            else:
                final = final_result(job.id, "expired", None, self.worker, now, job.queued_at)
            self.holdings.end(job, final)
            return
        self.add_to_engine(job, encode_start(self.worker, now, job.resumed_tokens, job.output_format))

    def _resume_all(self, resumed: list[tuple[Delivery, str, Job, int]]) -> None:
        try:
            events = self.job_commands.recorded_events([job.id for _, _, job, _ in resumed])
        except redis.RedisError:
            self.holdings.take([d for d, _, _, _ in resumed])  # claimed again at the next try, with a new run
            raise
        for d, run, job, recorded_tokens in resumed:
            if not self._took_over(job, events[job.id], recorded_tokens):
                continue
            if d.deliveries > self.settings.max_deliveries:
                self._dead_letter_poison(d, run, recorded_tokens, job)
            else:
                log.info("job %s: resuming after %d recorded tokens", job.id, job.resumed_tokens)
                self.start_unless_expired(job)

    def _took_over(self, job: Job, events: list[tuple[str, dict[str, str]]] | Exception, recorded_tokens: int) -> bool:
        """Take over the tokens the job's events record: as many as its hash counts, or it fails.
        Producers may write both keys, so neither is trusted to be readable or to agree."""
        if isinstance(events, Exception):
            self.rejections.of_job(job, events)
            return False
        try:
            job.resume(events)
        except Exception as e:  # events this worker cannot read: fail the job, not the worker
            self.rejections.of_job(job, InvalidJob(f"its recorded events cannot be read: {type(e).__name__}: {e}"))
            return False
        if job.resumed_tokens != recorded_tokens:
            error = InvalidJob(f"its hash records {recorded_tokens} tokens, its event stream {job.resumed_tokens}")
            self.rejections.of_job(job, error)
            return False
        return True

    def _dead_letter_poison(self, d: Delivery, run: str, recorded_tokens: int, job: Job | None = None) -> None:
        """`job`: the job with the tokens its earlier runs recorded, which its failed result holds."""
        error = Poison(
            f"delivered {d.deliveries} times, more than max_deliveries {self.settings.max_deliveries}: "
            "every worker that took it stopped before finishing it"
        )
        log.warning("job %s: %s; moving entry %s to the dead-letter stream", d.job_id, error.message, d.entry_id)
        now = self.clock.now()
        if job is not None:
            final = job.result("failed", "error", self.worker, now, error=error)
        else:
            final = final_result(d.job_id, "failed", "error", self.worker, now, entry_time(d.entry_id), error=error)
        self.holdings.dead_letter(d, run, recorded_tokens, final, error.message)


def log_reclaimed(deliveries: list[Delivery], min_idle_ms: int, where: str = "") -> None:
    """Says which entries a drain handed over and which were reclaimed from a worker that died or
    stalled, with the idle time that took them (`where`: whose stream, if not the shared one)."""
    handed = [d for d in deliveries if d.handed_over]
    idle = [d for d in deliveries if not d.handed_over]
    if handed:
        log.info("took over %d entries%s that a draining worker handed over: %s", len(handed), where, _listed(handed))
    if idle:
        log.info("reclaimed %d entries%s idle over %d ms: %s", len(idle), where, min_idle_ms, _listed(idle))


def _listed(deliveries: list[Delivery]) -> str:
    return ", ".join(f"{d.job_id} (delivery {d.deliveries})" for d in deliveries)
