"""When an engine step raises: find the job that makes steps fail, fail it alone, and let the
others go on without losing a token."""

from __future__ import annotations

import logging

from producer_client.errors import MiliError
from worker.loop.admission import Admission
from worker.loop.context import LoopContext
from worker.loop.jobs import Job

log = logging.getLogger(__name__)


class EngineError(MiliError):
    """An engine step raised, and this job was the one that made it fail."""

    code = "engine_error"


class FailureIsolation:
    """After a failed step every job leaves the engine. The one that failed a step alone, or the
    suspect re-added last that has produced nothing since, fails; the rest become suspects,
    re-added one at a time from their tokens so far (KV pages of aborted jobs stay in the prefix
    cache, so that is cheap), each once the one before has produced output. A fault tied to a
    job's next position shows at its first step back, so it names its job."""

    def __init__(self, ctx: LoopContext, admission: Admission):
        self.holdings, self.clock, self.worker = ctx.holdings, ctx.clock, ctx.worker
        self.admission = admission
        self.probe: Job | None = None  # the suspect re-added last: cleared once it produces output

    @property
    def busy(self) -> bool:
        """Suspects are being tried: no new job is admitted meanwhile."""
        return bool(self.holdings.suspects) or self.probe is not None

    def isolate(self, error: EngineError) -> None:
        running = self.holdings.running
        live = list(running.values())
        culprit = self.probe if self.probe is not None and self.probe.id in running else None
        if culprit is None and len(live) == 1:
            culprit = live[0]
        self.probe = None
        for job in live:  # each leaves the engine
            if job is culprit:
                log.warning("job %s fails: an engine step failed with it: %s", job.id, error.message)
                self.holdings.end(job, job.result("failed", "error", self.worker, self.clock.now(), error=error))
            else:
                self.holdings.suspect(job)
        if self.holdings.suspects:
            log.warning(
                "re-adding %d jobs one per step to find the one that makes steps fail", len(self.holdings.suspects)
            )

    def try_next_suspect(self) -> None:
        if self.probe is not None or not self.holdings.suspects:
            return
        job = self.holdings.next_suspect()
        now = self.clock.now()
        if job.deadline is not None and now > job.deadline:
            self.holdings.end(job, job.result("done", "timeout", self.worker, now))
            return
        if self.admission.add_to_engine(job):
            self.probe = job

    def produced_output(self, job: Job) -> None:
        """`job` got through a step: if it was the probe, the next suspect may come back."""
        if job is self.probe:
            self.probe = None
