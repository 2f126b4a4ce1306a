"""Rejection: one job's Redis errors are that job's failure. Producers may write a job's keys (its
hash, event stream and done stream) and its queue entry, so any of them may hold what the
protocol does not define: a key of another type, a field no script can read, events that
disagree with the hash. Whatever command meets it (a claim, the read of a resumed job's events,
a publication, the look at a running job's flags, an adoption) charges the error to that job:
it leaves the engine, and FAIL writes its failure, with the output it had, whatever its run and
recorded tokens; its entry is then acknowledged. The worker and its other jobs go on.

The code: `internal_error` for a reply the protocol does not define (UnknownReply), else
`invalid_job`. Transient errors never come here: they keep their retry path (worker/loop/queue.py)."""

from __future__ import annotations

import logging

from producer_client.errors import MiliError
from producer_client.keys import PROTOCOL_VERSION
from producer_client.protocol.clock import entry_time
from producer_client.protocol.replies import Failed, UnknownReply
from producer_client.schema import ErrorInfo
from worker.loop.context import LoopContext
from worker.loop.intake import Delivery
from worker.loop.jobs import InternalError, InvalidJob, Job, final_result, printable
from worker.loop.outbox import Rejection, Update
from worker.loop.queue import is_transient

log = logging.getLogger(__name__)


def job_error(error: Exception) -> MiliError:
    """What a job fails with for an error its keys gave."""
    if isinstance(error, MiliError):
        return error
    if isinstance(error, UnknownReply):
        return InternalError(str(error))
    return InvalidJob(f"Redis refused a command on the job's keys: {type(error).__name__}: {error}")


class Rejections:
    def __init__(self, ctx: LoopContext):
        self.job_commands, self.holdings = ctx.job_commands, ctx.holdings
        self.metrics, self.clock, self.worker = ctx.metrics, ctx.clock, ctx.worker

    # -- what fails a job -----------------------------------------------------------------------

    def of_delivery(self, d: Delivery, error: Exception) -> None:
        """An entry whose claim the job's keys refused: it never ran here."""
        result = final_result(
            d.job_id,
            "failed",
            "error",
            self.worker,
            self.clock.now(),
            entry_time(d.entry_id),
            error=job_error(error),
        )
        self._hold(Rejection(result, d.entry_id, d.fields, d.deliveries))

    def of_job(self, job: Job, error: Exception) -> None:
        """A claimed job: its result keeps the output it had."""
        result = job.result("failed", "error", self.worker, self.clock.now(), error=job_error(error))
        fields = {"id": job.id, "v": str(PROTOCOL_VERSION), "body": job.request.to_json()}
        self._hold(Rejection(result, job.entry_id, fields))

    def of_update(self, update: Update, error: Exception) -> None:
        """A job whose update Redis refused: the job while it runs, else its final result's output."""
        job = self.holdings.find(update.job_id)
        if job is not None:
            self.of_job(job, error)
            return
        now = self.clock.now()
        failed = job_error(error)
        if update.final is not None:
            info = ErrorInfo(code=failed.code, message=printable(failed.message))
            result = update.final.model_copy(update={"status": "failed", "finish_reason": "error", "error": info})
        else:
            queued_at = now if update.entry_id is None else entry_time(update.entry_id)
            result = final_result(update.job_id, "failed", "error", self.worker, now, queued_at, error=failed)
        self._hold(Rejection(result, update.entry_id, {"id": update.job_id}))

    def of_held(self, job_id: str, error: Exception) -> None:
        """A job held here, wherever it is (see Holdings)."""
        job = self.holdings.find(job_id)
        update = self.holdings.waiting_update(job_id)
        if job is not None:
            self.of_job(job, error)
        elif update is not None:
            self.of_update(update, error)
        else:
            self.holdings.drop(job_id)

    def _hold(self, rejection: Rejection) -> None:
        log.warning("job %s fails: %s", rejection.job_id, rejection.error.message)
        self.holdings.reject(rejection)

    # -- writing the failures ---------------------------------------------------------------------

    def send(self) -> None:
        """FAIL every rejected job. A transient refusal keeps those for the next try and raises
        once the others are settled."""
        pending = self.holdings.rejected
        if not pending:
            return
        replies = self.job_commands.fail([(r.job_id, r.result) for r in pending])
        refused: Exception | None = None
        for rejection, reply in zip(pending, replies):
            if isinstance(reply, Exception) and is_transient(reply):
                refused = refused or reply
                continue
            self._settle(rejection, reply)
        if refused is not None:
            raise refused

    def _settle(self, rejection: Rejection, reply: Failed | Exception) -> None:
        if isinstance(reply, Exception):
            # Nothing can be written for the job: its entry goes where an operator looks.
            log.error("job %s: Redis refused even its failure: %s", rejection.job_id, reply)
            reason = f"its keys refused the protocol: {rejection.error.message}; and FAIL: {reply}"
            self.holdings.failure_refused(rejection, reason)
            return
        self.holdings.failure_written(rejection)
        if reply is Failed.FAILED:
            self.metrics.job_ended(rejection.result)
            error = rejection.error
            log.info("job %s failed (%s): %s", rejection.job_id, error.code, error.message)
