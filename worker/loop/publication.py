"""Publication: what the worker tells Redis about its jobs, in rounds. Each round is one pipeline,
sent by the publisher's thread (worker/loop/publisher.py) while the loop steps on: every update waiting
(ends, starts, failures, and what an earlier round could not deliver), the output of the running
jobs whose publication is due (worker/loop/pace.py), each as one PUBLISH (the round's together in
PUBLISH_ROUND calls: worker/loop/job_commands.py), and a look at the hash of the running jobs due
for one. One round is out at a time; the output of the steps that run meanwhile waits for the next.

What Redis answers settles the jobs here, in the loop's thread: a written result acknowledges its
entry, a lost run stops the job, a cancel flag stops it, a reader's FOLLOW makes it streamed, a
refusal for now keeps the update for the next try, and an answer the protocol does not define
fails the job."""

from __future__ import annotations

import logging
import time

from producer_client.protocol.replies import Look, Published, PublishReply, UnknownReply, Watched
from producer_client.schema import JobResult
from worker.loop.context import LoopContext
from worker.loop.done_sweep import DoneSweep
from worker.loop.jobs import InternalError, Job
from worker.loop.outbox import Update
from worker.loop.pace import Pace
from worker.loop.publisher import Publisher, Round
from worker.loop.queue import GroupLost, is_transient
from worker.loop.rejection import Rejections

log = logging.getLogger(__name__)


class Publication:
    def __init__(self, ctx: LoopContext, rejections: Rejections, pace: Pace):
        self.queue, self.holdings = ctx.queue, ctx.holdings
        self.metrics, self.clock, self.worker = ctx.metrics, ctx.clock, ctx.worker
        self.rejections = rejections
        self.pace = pace
        self.publisher = Publisher(ctx.job_commands)
        self.done_sweep = DoneSweep()
        self.last_call = time.monotonic()
        self.starts = 0  # the holdings' starts the pace has been told of

    @property
    def busy(self) -> bool:
        return self.publisher.busy

    def publish(self) -> None:
        """Settle the round Redis has answered, if any, then send what is due, without waiting for
        the answer. Raises a transient error after settling what Redis took: what it refused waits."""
        now = time.monotonic()
        answered = self.publisher.take_answer()
        self.pace.measured(now - self.last_call, None if answered is None else answered.seconds)
        self.last_call = now
        if answered is not None:
            self._settle(answered)
        if not self.publisher.busy:
            if self.holdings.starts != self.starts:
                self.starts = self.holdings.starts
                self.pace.wake()  # a job the pace's last pass did not see: its look may be due
            self._send(*self.pace.plan(self.holdings.running.values(), now), now)

    def settle_out(self, timeout: float | None = None) -> None:
        """Wait for the round out, if any, up to `timeout` seconds (None: as long as it takes), and
        settle it."""
        answered = self.publisher.take_answer(timeout)
        if answered is not None:
            self._settle(answered)

    def flush(self) -> None:
        """Everything Redis has not taken, due or not, sent and settled before this returns."""
        self.settle_out()
        if self.holdings.take_all_output():
            self._send([], [], time.monotonic())
            self.settle_out()

    def close(self) -> None:
        self.publisher.close()

    def _send(self, due: list[Job], look: list[Job], now: float) -> None:
        for job in due:
            self.holdings.take_output(job)
            job.feed.looked_at = now  # its publication's answer tells what a look would
        watch = []
        for job in look:
            if job.stop_reason is None and not self.holdings.has_update(job.id):
                watch.append((job.id, job.run))
                job.feed.looked_at = now
            else:
                self.pace.wake()  # its look stays due, asked again next iteration
        updates = self.holdings.send_updates()
        forget = self.done_sweep.due(now)
        if updates or watch or forget:
            self.publisher.send(Round(updates, watch, forget))

    def _settle(self, answered: Round) -> None:
        if answered.error is not None:
            for update in answered.updates:
                if self.holdings.answered(update):
                    self.holdings.restore(update)
            raise answered.error
        gone: list[str] = []  # jobs whose hash Redis no longer has
        refused = self._settle_updates(answered, gone)  # a transient refusal: those updates wait, the link backs off
        for (job_id, _), state in zip(answered.watch, answered.watched):
            if isinstance(state, Exception) and is_transient(state):
                refused = refused or state
            elif isinstance(state, Look) and state.state is Watched.GONE:
                gone.append(job_id)
            else:
                self._react(job_id, state)
        if refused is not None:
            raise refused
        if gone:
            self._account_for_gone(gone)

    def _settle_updates(self, answered: Round, gone: list[str]) -> Exception | None:
        """Each update's reply, the jobs gone added to `gone`; the first transient refusal, if any.
        The results written are counted together (WorkerMetrics.jobs_ended), whatever happens."""
        refused: Exception | None = None
        ended: list[JobResult] = []
        try:
            for update, reply in zip(answered.updates, answered.published):
                if not self.holdings.answered(update):
                    continue  # let go of while it was out
                if isinstance(reply, PublishReply) and (
                    reply.outcome is Published.OK or (reply.outcome is Published.FOLLOWED and update.streamed)
                ):
                    # Recorded, and the job runs on: most of a round's replies. A streamed job's are
                    # FOLLOWED (its flag is up), which tells this run nothing new once it streams it.
                    continue
                if isinstance(reply, Exception) and is_transient(reply):
                    refused = refused or reply
                    self.holdings.restore(update)
                elif isinstance(reply, PublishReply) and reply.outcome is Published.GONE:
                    gone.append(update.job_id)
                    self.holdings.restore(update)
                else:
                    self._settle_update(update, reply, ended)
        finally:
            self.metrics.jobs_ended(ended)
        return refused

    def _account_for_gone(self, job_ids: list[str]) -> None:
        """Jobs whose hash Redis no longer has. If the queue's group is gone too, Redis lost its
        data: the jobs (their updates kept) are adopted before the next read. Otherwise their keys
        were deleted by hand, and they stop here."""
        if not self.queue.groups.exist():
            raise GroupLost(f"the hashes of {len(job_ids)} running jobs and the group are gone")
        for job_id in job_ids:
            log.warning("job %s: its keys were deleted while it ran; this run stops", job_id)
            self.holdings.drop(job_id)

    def _settle_update(self, update: Update, reply: PublishReply | Exception, ended: list[JobResult]) -> None:
        """`ended`: gets the result of a job that ended here, to be counted."""
        if isinstance(reply, UnknownReply):
            self._fail_on_unknown_reply(update, reply)
        elif isinstance(reply, Exception):
            self.rejections.of_update(update, reply)  # the job's keys refused PUBLISH
        elif reply.outcome is Published.PARTIAL and update.skip_recorded(reply.recorded):
            self.holdings.restore(update)  # the rest goes with the next publication
        elif reply.outcome in (Published.LOST, Published.PARTIAL):
            log.warning("job %s: another worker has taken it over; this run stops", update.job_id)
            self.holdings.drop(update.job_id)
        elif reply.outcome in (Published.WRITTEN, Published.ENDED):
            self.holdings.written(update)  # ENDED: ended elsewhere while it ran here, a result exists
            if reply.outcome is Published.WRITTEN and update.final is not None:
                self._count_end(update, ended)
                self.done_sweep.add(update.job_id, time.monotonic())
        elif reply.outcome is Published.CANCEL:
            self._react(update.job_id, Look(Watched.CANCEL))
        elif reply.outcome is Published.FOLLOWED:
            self._react(update.job_id, Look(Watched.OK, streamed=True))

    def _fail_on_unknown_reply(self, update: Update, error: UnknownReply) -> None:
        """The job fails with internal_error, its tokens kept for the result; if even its final
        update gets an answer PUBLISH does not give, FAIL writes the failure (worker/loop/rejection.py)."""
        log.error("job %s: %s", update.job_id, error)
        job = self.holdings.running.get(update.job_id)
        if update.final is not None or job is None:
            self.rejections.of_update(update, error)
            return
        self.holdings.restore(update)
        self.holdings.end(
            job, job.result("failed", "error", self.worker, self.clock.now(), error=InternalError(str(error)))
        )

    def _react(self, job_id: str, look: Look | Exception) -> None:
        if isinstance(look, Exception):
            self.rejections.of_held(job_id, look)  # its keys refused the look at its flags
            return
        if look.state is Watched.LOST:
            log.warning("job %s: another worker has taken it over; this run stops", job_id)
            self.holdings.drop(job_id)
            return
        job = self.holdings.running.get(job_id)
        if job is None:
            return
        if look.streamed and not job.feed.streamed:
            log.info("job %s: a reader follows it; its tokens go out as they come", job_id)
            job.feed.streamed = True
            self.pace.wake()  # its slots start now
        if look.state is Watched.CANCEL and job.stop_reason is None:
            log.info("job %s cancelled while running", job_id)
            self.holdings.stop(job, "cancel")

    def _count_end(self, update: Update, ended: list[JobResult]) -> None:
        result = update.ended()
        if update.dead_letter is not None:
            self.metrics.jobs["dead_lettered"].inc()
        else:
            ended.append(result)
        log_end(result)


def log_end(result: JobResult) -> None:
    if not log.isEnabledFor(logging.INFO):  # its arguments cost more than the call
        return
    t, u = result.timings, result.usage
    log.info(
        "job %s %s (%s): %d prompt tokens (%d cached), %d output tokens; queue %s ttft %s e2e %s%s",
        result.id,
        result.status,
        result.finish_reason,
        u.prompt_tokens,
        u.cached_prompt_tokens,
        u.completion_tokens,
        _secs(t.queue_s),
        _secs(t.ttft_s),
        _secs(t.e2e_s),
        f"; {result.error.code}: {result.error.message}" if result.error else "",
    )


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
