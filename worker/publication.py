"""Publication: every job's update goes to Redis in one pipeline per loop iteration (PUBLISH), and
what Redis answers settles the job here: a written result acknowledges its entry, a lost run
stops the job, a cancel flag stops it within a step, a refusal for now keeps the update for the
next try, and an answer the protocol does not define fails the job."""
from __future__ import annotations

import logging

from producer_client.schema import JobResult
from worker.holdings import Holdings
from worker.jobs import InternalError
from worker.metrics import WorkerMetrics
from worker.outbox import Outbox, Receipts, Update
from worker.queue import GroupLost, RedisClock, WorkerQueue, is_transient
from worker.rejection import Rejections
from worker.replies import Published, PublishReply, UnknownReply, Watched

log = logging.getLogger(__name__)


class Publication:
    def __init__(
        self, queue: WorkerQueue, holdings: Holdings, outbox: Outbox, receipts: Receipts, rejections: Rejections,
        metrics: WorkerMetrics, clock: RedisClock, worker: str,
    ):
        self.queue = queue
        self.holdings = holdings
        self.outbox = outbox
        self.receipts = receipts
        self.rejections = rejections
        self.metrics = metrics
        self.clock = clock
        self.worker = worker

    def publish(self) -> None:
        """Send every update, and look at the cancel flag and run of each running job that has
        none. Raises a transient error after settling what Redis took: what it refused stays."""
        updates = list(self.outbox.updates.values())
        watch = [
            (job.id, job.run) for job in self.holdings.running.values()
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
            self.holdings.drop(job_id)

    def _settle(self, update: Update, reply: PublishReply | Exception) -> None:
        if isinstance(reply, UnknownReply):
            self._fail_on_unknown_reply(update, reply)
        elif isinstance(reply, Exception):
            self.rejections.of_update(update, reply)  # the job's keys refused PUBLISH
        elif reply.outcome is Published.PARTIAL and update.skip_recorded(reply.recorded):
            self.outbox.add(update)  # the rest goes with the next publication
        elif reply.outcome in (Published.LOST, Published.PARTIAL):
            log.warning("job %s: another worker has taken it over; this run stops", update.job_id)
            self.holdings.drop(update.job_id)
        elif reply.outcome in (Published.WRITTEN, Published.ENDED):
            self.holdings.drop(update.job_id)  # ended elsewhere while it ran here: a result exists
            if update.dead_letter is not None:
                self.receipts.dead_letters.append(update.dead_letter)
            elif update.entry_id is not None:
                self.receipts.acks.append(update.entry_id)
            if reply.outcome is Published.WRITTEN and update.final is not None:
                self._count_end(update)
        elif reply.outcome is Published.CANCEL:
            self._react(update.job_id, Watched.CANCEL)

    def _fail_on_unknown_reply(self, update: Update, error: UnknownReply) -> None:
        """The job fails with internal_error, its tokens kept for the result; if even its final
        update gets an answer PUBLISH does not give, FAIL writes the failure (worker/rejection.py)."""
        log.error("job %s: %s", update.job_id, error)
        job = self.holdings.running.pop(update.job_id, None)
        if update.final is not None or job is None:
            self.rejections.of_update(update, error)
            return
        self.holdings.abort(job)
        update.final = job.result("failed", "error", self.worker, self.clock.now(), error=InternalError(str(error)))
        self.outbox.add(update)

    def _react(self, job_id: str, state: Watched | Exception) -> None:
        if isinstance(state, Exception):
            self.rejections.of_held(job_id, state)  # its keys refused the look at its flags
            return
        if state is Watched.LOST:
            log.warning("job %s: another worker has taken it over; this run stops", job_id)
            self.holdings.drop(job_id)
            return
        job = self.holdings.running.get(job_id)
        if state is Watched.CANCEL and job is not None and job.stop_reason is None:
            log.info("job %s cancelled while running", job_id)
            self.holdings.stop(job, "cancel")

    def _count_end(self, update: Update) -> None:
        if update.dead_letter is not None:
            self.metrics.jobs["dead_lettered"].inc()
        else:
            self.metrics.job_ended(update.final)
        log_end(update.final)


def log_end(result: JobResult) -> None:
    if not log.isEnabledFor(logging.INFO):  # its arguments cost more than the call
        return
    t, u = result.timings, result.usage
    log.info(
        "job %s %s (%s): %d prompt tokens (%d cached), %d output tokens; queue %s ttft %s e2e %s%s",
        result.id, result.status, result.finish_reason, u.prompt_tokens, u.cached_prompt_tokens,
        u.completion_tokens, _secs(t.queue_s), _secs(t.ttft_s), _secs(t.e2e_s),
        f"; {result.error.code}: {result.error.message}" if result.error else "",
    )


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
