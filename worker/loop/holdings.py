"""Every job a worker holds, from its entry's delivery until Redis has its final result and the
entry is acknowledged: the one writer of that state. The loop's parts change it only through the
verbs here, and read it through read-only views and queries:

- entries: take (read, reclaimed, stolen), claims_answered, then each settles once: ack_duplicate,
  end_delivery, dead_letter, or a job; entries_lost when Redis lost the group;
- jobs: start, finished (the engine ended it), end (this worker ends it), suspect, next_suspect,
  stop, drop, detach;
- what Redis has not seen (outbox.py): collected (the tokens a step added), take_output,
  send_updates, answered, restore, written, republish_whole; reject, failure_written,
  failure_refused; receipts_sent (with what the lanes' counters are owed once each entry is
  settled: fairness.py).

A verb raises HeldStateError rather than make a change the protocol never makes: a job started
while a run of it is held, a run ended twice, an entry acknowledged or dead-lettered that no
answered claim, written result or settled failure gives back."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType

from producer_client.schema import JobResult
from worker.engine.interface import EngineAPI
from worker.loop.fairness import Ledger, Owed
from worker.loop.intake import Delivery
from worker.loop.jobs import Job
from worker.loop.outbox import DeadLetter, HeldStateError, Outbox, Rejection, Update

log = logging.getLogger(__name__)


class Deliveries:
    """Entries taken (read, reclaimed, stolen) and not yet claimed; then, once Redis answered
    their claims, each settled once: by a verb of Holdings, or as a job."""

    def __init__(self) -> None:
        self.unadmitted: list[Delivery] = []
        self.answered: dict[int, Delivery] = {}  # by identity: claimed in the last admission, not yet settled

    def claims_answered(self) -> None:
        self.answered = {id(d): d for d in self.unadmitted}
        self.unadmitted = []

    def settle(self, d: Delivery) -> None:
        if self.answered.pop(id(d), None) is not d:
            raise HeldStateError(f"entry {d.entry_id} of job {d.job_id}: settled without an answered claim, or twice")

    def lost(self) -> None:
        """Their entries went with the queue's group."""
        self.unadmitted, self.answered = [], {}

    def drop(self, job_id: str) -> None:
        self.unadmitted = [d for d in self.unadmitted if d.job_id != job_id]


class Claimed:
    """The claimed jobs that have, or had, a place in the engine: running there, and the suspects,
    out of it after a failed step until each is tried again alone (worker/loop/isolation.py). Apart
    from the entries and the outbox because only these are the engine's too: a job leaves them
    through the engine's abort, whatever Holdings' verb lets it go."""

    def __init__(self, engine: EngineAPI):
        self.engine = engine
        self.running: dict[str, Job] = {}
        self.suspects: deque[Job] = deque()
        # Kept as jobs start and leave (a job's lane and deadline are set before it starts), for
        # what the loop asks before every step: the running jobs of each lane (Admission.rooms)
        # and those with a deadline (Worker._stop_overdue). Counted anew over every running job,
        # they were two passes of max_running jobs an iteration (bench/RESULTS.md, y/pub5).
        self.lanes: dict[str, int] = {}
        self.timed: dict[str, Job] = {}
        self.starts = 0  # jobs started so far: the pace hears of each (Publication.publish)

    def find(self, job_id: str) -> Job | None:
        """A claimed job by id: looked up in the engine's jobs (every claim of an entry asks, so
        not by scanning max_running of them), else among the suspects, who are few and rare."""
        job = self.running.get(job_id)
        if job is None and self.suspects:
            job = next((j for j in self.suspects if j.id == job_id), None)
        return job

    def all(self) -> list[Job]:
        return [*self.running.values(), *self.suspects]

    def start(self, job: Job) -> None:
        if self.find(job.id) is not None:
            raise HeldStateError(f"job {job.id}: run {job.run} started while a run of it is held")
        self.running[job.id] = job
        self.starts += 1
        lane = job.route.lane
        self.lanes[lane] = self.lanes.get(lane, 0) + 1
        if job.deadline is not None:
            self.timed[job.id] = job

    def finished(self, job: Job) -> None:
        if self.running.get(job.id) is not job:
            raise HeldStateError(f"job {job.id}: run {job.run} finished in the engine without running there")
        self._leave(job)

    def end(self, job: Job) -> None:
        if self.running.get(job.id) is job:
            self._leave(job)
            self.abort(job)

    def suspect(self, job: Job) -> None:
        if self.running.get(job.id) is not job:
            raise HeldStateError(f"job {job.id}: made a suspect without running")
        self._leave(job)
        self.abort(job)
        self.suspects.append(job)

    def drop(self, job_id: str) -> None:
        job = self.running.get(job_id)
        if job is not None:
            self._leave(job)
            self.abort(job)
        if self.suspects:
            self.suspects = deque(j for j in self.suspects if j.id != job_id)

    def _leave(self, job: Job) -> None:
        """A running job leaves the engine's jobs (it runs there: the caller checked)."""
        del self.running[job.id]
        self.lanes[job.route.lane] -= 1
        self.timed.pop(job.id, None)

    def unpublished_tokens(self) -> int:
        """Their output no update holds. List comprehensions over the running jobs where they are (a
        generator over all()'s copy cost a fifth more)."""
        in_jobs = sum([len(j.token_ids) - j.feed.tokens for j in self.running.values()])
        if self.suspects:
            in_jobs += sum([len(j.token_ids) - j.feed.tokens for j in self.suspects])
        return in_jobs

    def abort(self, job: Job) -> None:
        try:
            self.engine.abort(job.engine_id)
        except Exception:
            log.exception("job %s: the engine's abort raised", job.id)


class Holdings:
    """A job is held from its delivery until its final result is in Redis: delivered and not yet
    admitted (its claim not settled), running in the engine, out of the engine after a failed
    step (a suspect), ended with an update Redis has not seen (in the outbox, which also holds
    the published output of running jobs that Redis has not answered yet), or rejected for its
    keys (see worker/loop/rejection.py). Each held entry is refreshed with every heartbeat. Each
    place is a part (Deliveries, Claimed, the Outbox); the verbs here move a job between them."""

    def __init__(self, engine: EngineAPI):
        self._outbox = Outbox()  # what Redis has not seen: updates, failures, receipts
        self._deliveries = Deliveries()
        self._claimed = Claimed(engine)  # in the engine, or suspects
        self.running: Mapping[str, Job] = MappingProxyType(self._claimed.running)
        self.running_lanes: Mapping[str, int] = MappingProxyType(self._claimed.lanes)  # jobs of each lane
        self.timed: Mapping[str, Job] = MappingProxyType(self._claimed.timed)  # the running jobs with a deadline
        self.find = self._claimed.find  # asked at every claim: no call of its own in between
        # At least unpublished_tokens(): the count when it was last made, raised since by whatever
        # can raise the count (tokens collected, a job started, an update restored or republished),
        # so that the check before every step sums over the running jobs only near its limit.
        self._unpublished_at_most = 0

    # -- views ----------------------------------------------------------------------------------

    @property
    def starts(self) -> int:
        """How many jobs have started in the engine (a suspect's return included): a new one may
        be due for a look before its first output (worker/loop/pace.py)."""
        return self._claimed.starts

    @property
    def unadmitted(self) -> tuple[Delivery, ...]:
        """Entries taken and not yet claimed."""
        return tuple(self._deliveries.unadmitted)

    @property
    def suspects(self) -> tuple[Job, ...]:
        return tuple(self._claimed.suspects)

    @property
    def rejected(self) -> tuple[Rejection, ...]:
        return tuple(self._outbox.rejected.values())

    def receipts(self) -> tuple[list[str], list[DeadLetter]]:
        """(entries to acknowledge and delete, entries to dead-letter) with the next read: copies."""
        return list(self._outbox.receipts.acks), list(self._outbox.receipts.dead_letters)

    @property
    def ledger(self) -> Ledger:
        """What the lanes' counters are owed (sent with the next read) and the tokens served."""
        return self._outbox.ledger

    def has_updates(self) -> bool:
        """Updates waiting or out."""
        return bool(self._outbox)

    def has_update(self, job_id: str) -> bool:
        return job_id in self._outbox.updates or job_id in self._outbox.out

    def waiting_update(self, job_id: str) -> Update | None:
        return self._outbox.updates.get(job_id)

    def unsettled(self) -> bool:
        """Anything held but the engine's jobs and the entries not yet admitted: suspects,
        rejections, updates or receipts."""
        return bool(self._claimed.suspects or self._outbox.rejected or self._outbox or self._outbox.receipts)

    def ended(self) -> int:
        """Jobs out of the engine whose entry waits for Redis to take their result."""
        return self._outbox.ended_count()

    def ended_lanes(self) -> list[str]:
        """The lane of each job ended() counts."""
        return self._outbox.ended_lanes()

    def entries(self) -> dict[str, str]:
        """{entry id: job id} of the entries this worker holds. Detached jobs have none."""
        held = {d.entry_id: d.job_id for d in self._deliveries.unadmitted}
        held.update((u.entry_id, u.job_id) for u in self._outbox.held() if u.entry_id is not None)
        held.update((job.entry_id, job.id) for job in self.claimed() if job.entry_id is not None)
        held.update((r.entry_id, r.job_id) for r in self._outbox.rejected.values() if r.entry_id is not None)
        return held

    def runs(self) -> dict[str, str]:
        """{job id: run token} of every claimed job."""
        held = {u.job_id: u.run for u in self._outbox.held()}
        for job in self.claimed():
            held.setdefault(job.id, job.run)
        return held

    def claimed(self) -> list[Job]:
        """Jobs in the engine and suspects."""
        return self._claimed.all()

    def detached(self) -> list[Job]:
        return [job for job in self.claimed() if job.entry_id is None]

    def unpublished_tokens(self) -> int:
        """Tokens Redis has not taken yet: in updates, and in claimed jobs' output no update holds."""
        return self._outbox.buffered_tokens() + self._claimed.unpublished_tokens()

    def unpublished_reach(self, limit: int) -> bool:
        """Whether unpublished_tokens() >= `limit`: counted only once the bound has reached it."""
        if self._unpublished_at_most < limit:
            return False
        self._unpublished_at_most = self.unpublished_tokens()
        return self._unpublished_at_most >= limit

    def collected(self, tokens: int) -> None:
        """An engine step added `tokens` to the claimed jobs' output (worker/loop/collection.py)."""
        self._unpublished_at_most += tokens

    # -- entries --------------------------------------------------------------------------------

    def take(self, deliveries: list[Delivery]) -> None:
        """Entries read, reclaimed or stolen: held until their claims are settled."""
        self._deliveries.unadmitted += deliveries
        self._outbox.ledger.charge(deliveries)

    def claims_answered(self) -> None:
        """Redis answered the claims of the entries taken: each is settled now, by one of the
        verbs below or as a job (running, ended, rejected or dropped)."""
        self._deliveries.claims_answered()

    def ack_duplicate(self, d: Delivery) -> None:
        """An entry whose claim found its job ended, or running under another entry: acknowledged
        with the next read."""
        self._deliveries.settle(d)
        self._outbox.ack(d.entry_id)

    def end_delivery(self, d: Delivery, run: str, recorded_tokens: int, result: JobResult) -> None:
        """A claimed entry that ends before it becomes a job (it cannot be read)."""
        self._deliveries.settle(d)
        self._outbox.add(Update(d.job_id, d.entry_id, run, recorded_tokens, final=result, lane=d.route.lane))

    def dead_letter(self, d: Delivery, run: str, recorded_tokens: int, result: JobResult, reason: str) -> None:
        """A claimed entry delivered too often: its job ends with `result`, and once that is written
        its entry moves to the dead-letter stream instead of being acknowledged."""
        self._deliveries.settle(d)
        letter = DeadLetter(d.entry_id, d.fields, reason, d.deliveries)
        self._outbox.add(
            Update(d.job_id, d.entry_id, run, recorded_tokens, final=result, dead_letter=letter, lane=d.route.lane)
        )

    def entries_lost(self) -> None:
        """Redis lost the queue's group: the entries not yet admitted, and those of rejected jobs,
        went with it."""
        self._deliveries.lost()
        for rejection in self._outbox.rejected.values():
            rejection.entry_id = None
        self._outbox.ledger.forget()

    # -- jobs -----------------------------------------------------------------------------------

    def start(self, job: Job, start_event: str = "") -> None:
        """The job is in the engine. `start_event`: its run's start, published with its next output."""
        self._claimed.start(job)
        update = self._outbox.for_job(job)
        if start_event:
            update.start = start_event
        self._unpublished_at_most += len(job.token_ids) - job.feed.tokens

    def finished(self, job: Job, result: JobResult) -> None:
        """The engine ended the job, with `result`."""
        self._claimed.finished(job)
        self._outbox.end(job, result)

    def end(self, job: Job, result: JobResult) -> None:
        """This worker ends the job with `result`: taken out of the engine if it runs there."""
        self._claimed.end(job)
        self._outbox.end(job, result)

    def suspect(self, job: Job) -> None:
        """A running job out of the engine after a failed step, to be tried again alone
        (worker/loop/isolation.py)."""
        self._claimed.suspect(job)

    def next_suspect(self) -> Job:
        return self._claimed.suspects.popleft()

    def stop(self, job: Job, reason: str) -> None:
        """Abort in the engine; its final output (finish_reason "abort") comes with the next step."""
        job.stop_reason = reason
        self._claimed.abort(job)

    def drop(self, job_id: str) -> None:
        """Let go of a job without acknowledging its entry: it is someone else's now, or final."""
        self._claimed.drop(job_id)
        self._deliveries.drop(job_id)
        self._outbox.discard(job_id)

    def detach(self, job_id: str) -> None:
        """Redis lost the job's entry: it runs on with none (see ADOPT in producer_client/protocol/worker.py)."""
        job = self.find(job_id)
        if job is not None:
            job.entry_id = None
        for update in self._outbox.held():
            if update.job_id == job_id:
                update.entry_id = None
                update.dead_letter = None  # no entry left to move

    # -- publication: what Redis has not seen ---------------------------------------------------

    def take_output(self, job: Job) -> None:
        """The job's output that no update holds yet goes into its update, for the next round."""
        self._outbox.for_job(job)

    def take_all_output(self) -> bool:
        """Every claimed job's output that no update holds yet, into its update; whether any waits."""
        for job in self.claimed():
            if job.feed.behind(job):
                self._outbox.for_job(job)
        return bool(self._outbox.updates)

    def send_updates(self) -> list[Update]:
        """Every waiting update, now out."""
        return self._outbox.send_all()

    def answered(self, update: Update) -> bool:
        """Whether `update`, sent, is still the job's (the job was not let go of meanwhile): then it
        is no longer out, and waits to be settled by the caller (restore, written, drop...)."""
        return self._outbox.answered(update)

    def restore(self, update: Update) -> None:
        """An update Redis did not take waits again, before whatever the job added since."""
        self._outbox.restore(update)
        self._unpublished_at_most += len(update.token_ids)

    def written(self, update: Update) -> None:
        """Redis has the job's result (this update's, or one written elsewhere while it ran here):
        the job is let go of, and its entry acknowledged or dead-lettered with the next read."""
        self._outbox.written(update)
        self.drop(update.job_id)

    def republish_whole(self, job_id: str, run: str, start_event: str) -> None:
        """Redis lost the job's events with its hash: its next publication carries `start_event`
        and the whole output so far (with the final result, if it has one)."""
        self._outbox.republish_whole(job_id, self.find(job_id), run, start_event)
        self._unpublished_at_most += len(self._outbox.updates[job_id].token_ids)

    def reject(self, rejection: Rejection) -> None:
        """Hold the job as rejected only: out of the engine, its update dropped."""
        self.drop(rejection.job_id)
        self._outbox.rejected[rejection.job_id] = rejection

    def failure_written(self, rejection: Rejection) -> None:
        """FAIL wrote the rejected job's failure: its entry is acknowledged with the next read."""
        self._outbox.failure_written(rejection)

    def failure_refused(self, rejection: Rejection, reason: str) -> None:
        """Redis refused even FAIL: the entry goes where an operator looks, the dead-letter stream."""
        self._outbox.failure_refused(rejection, reason)

    def receipts_sent(self, corrections: Owed | None = None) -> None:
        """Redis took the last read's acknowledgements, dead letters and `corrections` (ledger.owed's)."""
        self._outbox.receipts_sent(corrections or {})
