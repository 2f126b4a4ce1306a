"""Every job a worker holds, wherever it is: the loop's parts change what it holds through the
verbs here (take, clear_unadmitted, start, finish, suspect, next_suspect, abort), and read it
through read-only views."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Mapping
from types import MappingProxyType

from worker.engine.interface import EngineAPI
from worker.loop.intake import Delivery
from worker.loop.jobs import Job
from worker.loop.outbox import Outbox, Rejection

log = logging.getLogger(__name__)


class Holdings:
    """A job is held from its delivery until its final result is in Redis: delivered and not yet
    admitted (its claim not settled), running in the engine, out of the engine after a failed
    step (a suspect), ended with an update Redis has not seen (in the outbox, which also holds
    the published output of running jobs that Redis has not answered yet), or rejected for its
    keys (see worker/loop/rejection.py). Each held entry is refreshed with every heartbeat."""

    def __init__(self, engine: EngineAPI, outbox: Outbox):
        self.engine = engine
        self.outbox = outbox
        self._unadmitted: list[Delivery] = []
        self._running: dict[str, Job] = {}  # claimed and in the engine
        self.running: Mapping[str, Job] = MappingProxyType(self._running)
        self._suspects: deque[Job] = deque()  # claimed, out of the engine after a failed step
        self.rejected: dict[str, Rejection] = {}  # failed for their keys, the failure not yet written

    @property
    def unadmitted(self) -> tuple[Delivery, ...]:
        """Entries taken and not yet claimed."""
        return tuple(self._unadmitted)

    @property
    def suspects(self) -> tuple[Job, ...]:
        return tuple(self._suspects)

    def take(self, deliveries: list[Delivery]) -> None:
        """Entries read, reclaimed or stolen: held until their claims are settled."""
        self._unadmitted += deliveries

    def clear_unadmitted(self) -> None:
        """Their claims are settled (each is running, ended or dropped now), or their entries went
        with a consumer group Redis lost."""
        self._unadmitted = []

    def start(self, job: Job) -> None:
        """The job is in the engine."""
        self._running[job.id] = job

    def finish(self, job_id: str) -> Job | None:
        """The job is out of the engine: it ended, or this worker stopped it. None if it was not in."""
        return self._running.pop(job_id, None)

    def suspect(self, job: Job) -> None:
        """A job out of the engine after a failed step, to be tried again alone (worker/loop/isolation.py)."""
        self._suspects.append(job)

    def next_suspect(self) -> Job:
        return self._suspects.popleft()

    def entries(self) -> dict[str, str]:
        """{entry id: job id} of the entries this worker holds. Detached jobs have none."""
        held = {d.entry_id: d.job_id for d in self._unadmitted}
        held.update((u.entry_id, u.job_id) for u in self.outbox.held() if u.entry_id is not None)
        held.update((job.entry_id, job.id) for job in self.claimed() if job.entry_id is not None)
        held.update((r.entry_id, r.job_id) for r in self.rejected.values() if r.entry_id is not None)
        return held

    def runs(self) -> dict[str, str]:
        """{job id: run token} of every claimed job."""
        held = {u.job_id: u.run for u in self.outbox.held()}
        for job in self.claimed():
            held.setdefault(job.id, job.run)
        return held

    def claimed(self) -> list[Job]:
        """Jobs in the engine and suspects."""
        return [*self._running.values(), *self._suspects]

    def find(self, job_id: str) -> Job | None:
        """A claimed job by id: looked up in the engine's jobs (every claim of an entry asks, so
        not by scanning max_running of them), else among the suspects, who are few and rare."""
        job = self._running.get(job_id)
        if job is None:
            job = next((j for j in self._suspects if j.id == job_id), None)
        return job

    def detach(self, job_id: str) -> None:
        """Redis lost the job's entry: it runs on with none (see ADOPT in producer_client/protocol/worker.py)."""
        job = self.find(job_id)
        if job is not None:
            job.entry_id = None
        for update in self.outbox.held():
            if update.job_id == job_id:
                update.entry_id = None
                update.dead_letter = None  # no entry left to move

    def unpublished_tokens(self) -> int:
        """Tokens Redis has not taken yet: in updates, and in claimed jobs' output no update holds."""
        return self.outbox.buffered_tokens() + sum(len(j.token_ids) - j.feed.tokens for j in self.claimed())

    def detach_rejected(self) -> None:
        """Redis lost the group: the rejected jobs' entries went with it."""
        for rejection in self.rejected.values():
            rejection.entry_id = None

    def detached(self) -> list[Job]:
        return [job for job in self.claimed() if job.entry_id is None]

    def drop(self, job_id: str) -> None:
        """Let go of a job without acknowledging its entry: it is someone else's now, or final."""
        job = self._running.pop(job_id, None)
        if job is not None:
            self.abort(job)
        if self._suspects:
            self._suspects = deque(j for j in self._suspects if j.id != job_id)
        self._unadmitted = [d for d in self._unadmitted if d.job_id != job_id]
        self.outbox.discard(job_id)
        self.rejected.pop(job_id, None)

    def reject(self, rejection: Rejection) -> None:
        """Hold the job as rejected only: out of the engine, its update dropped."""
        self.drop(rejection.job_id)
        self.rejected[rejection.job_id] = rejection

    def stop(self, job: Job, reason: str) -> None:
        """Abort in the engine; its final output (finish_reason "abort") comes with the next step."""
        job.stop_reason = reason
        self.abort(job)

    def abort(self, job: Job) -> None:
        try:
            self.engine.abort(job.engine_id)
        except Exception:
            log.exception("job %s: the engine's abort raised", job.id)
