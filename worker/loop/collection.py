"""An engine step's outputs added to their jobs: tokens, text and logprobs to the job, where they
wait for their publication (pace.py); a job's end to its holdings as its final result."""

from __future__ import annotations

import logging
import time

from producer_client.schema import ErrorInfo, JobResult, TokenLogprob, Usage
from worker.engine.outputs import RequestOutput
from worker.loop.context import LoopContext
from worker.loop.isolation import FailureIsolation
from worker.loop.jobs import AdmissionId, Job
from worker.loop.pace import Pace

log = logging.getLogger(__name__)


class Collector:
    def __init__(self, ctx: LoopContext, isolation: FailureIsolation, pace: Pace):
        self.holdings, self.clock, self.metrics = ctx.holdings, ctx.clock, ctx.metrics
        self.worker = ctx.worker
        self.isolation = isolation
        self.pace = pace

    def collect(self, outputs: list[RequestOutput]) -> None:
        """Add each output to its job, where it waits for its publication (see pace.py); a job's
        end goes to the outbox (Holdings.finished). Run for every output of every step: kept to plain appends."""
        now = self.clock.now()
        sampled_at = time.monotonic()
        running = self.holdings.running
        probe = self.isolation.probe
        tokens = most = 0  # the step's tokens, and the most of them one job got (the pace's MAX_EVENT_TOKENS)
        first = False  # a run's first output is among them: due at once
        for out in outputs:
            # The loop's own request ids: every request it adds to the engine has an AdmissionId,
            # which the engine hands back as it was given (the identity test spares most outputs a
            # comparison). Not cast(): a call an output.
            request_id: AdmissionId = out.request_id  # type: ignore[assignment]
            try:
                # Subscripted: a mapping proxy's get() is a call by name of the dict's, twice the time
                # of its subscript, which raises nothing for a running job's output (most of them).
                job = running[request_id.job_id]
            except KeyError:
                continue  # an aborted admission's last word
            if request_id is not job.engine_id and request_id != job.engine_id:
                continue  # ditto, of a job running again since
            if job is probe:
                self.isolation.produced_output(job)
            new_token_ids = out.new_token_ids
            if new_token_ids or out.text_delta:
                # Written out here, not in a call: most outputs of most steps are a running job's
                # next token, and need nothing else.
                n = len(new_token_ids)
                tokens += n
                if n > most:
                    most = n
                job.token_ids += new_token_ids
                job.text.append(out.text_delta)
                feed = job.feed
                if feed.waiting_since is None:
                    feed.waiting_since = sampled_at
                    first = first or feed.tokens == job.resumed_tokens
                if job.first_token_at is None or out.logprobs is not None or job.call_watch is not None:
                    self._record_rest(job, out, now)
            if out.finished:
                self.holdings.finished(job, self._final_result(job, out, now))
        self.holdings.collected(tokens)
        self.pace.collected(most, first)
        self.metrics.generation_tokens.inc(tokens)

    def _record_rest(self, job: Job, out: RequestOutput, now: float) -> None:
        """What a delta brings beyond its tokens and text: the job's first token's time, the
        logprobs, a tool call the job stops at."""
        if out.new_token_ids and job.first_token_at is None:
            job.first_token_at = now
        if out.logprobs is not None:
            logprobs = [TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top=list(lp.top)) for lp in out.logprobs]
            if job.logprobs is None:
                job.logprobs = []
            job.logprobs += logprobs
        if job.call_watch is not None and job.stop_reason is None and job.watch_for_call(out.text_delta):
            log.info("job %s made its tool call (parallel_tool_calls is off): it ends here", job.id)
            self.holdings.stop(job, "tool_call")

    def _final_result(self, job: Job, out: RequestOutput, now: float) -> JobResult:
        u = out.usage
        usage = Usage(
            prompt_tokens=u.prompt_tokens,
            completion_tokens=u.completion_tokens,
            cached_prompt_tokens=u.cached_prompt_tokens,
        )
        if out.finish_reason == "abort":
            if job.stop_reason == "timeout":
                return job.result("done", "timeout", self.worker, now, usage)
            if job.stop_reason == "tool_call":
                return job.result("done", "stop", self.worker, now, usage)  # Job.result: stopped for its calls
            return job.result("cancelled", "abort", self.worker, now, usage)
        if out.error is not None:
            error = ErrorInfo(code=out.error.code, message=out.error.message)
            return job.result("failed", "error", self.worker, now, usage, error)
        return job.result("done", out.finish_reason, self.worker, now, usage)
