"""When a running job's output goes to Redis. Publishing every engine step would cost a PUBLISH per
running job per step (at batch 256 on a GPU, more Redis round-trip work than the step itself), so
each job's output waits in the job and goes out in pieces:

- a run's first tokens at once (the time to first token is the engine's), its end at once;
- a streamed job's (its `stream` option, or a reader's FOLLOW) once waiting any longer would bring
  them to their readers later than stream_interval_s after they were sampled, counting the time the
  loop and its rounds have recently taken (the lag); but never twice in one share of the interval,
  stream_interval_s * streams / max_running (a job's slots are a share apart, each taken by one
  publication at most). So a stream alone sees each step's tokens as they come, and a worker's
  streamed publications stay under max_running / stream_interval_s a second however many streams
  it runs and however far behind it falls: a loop that falls behind publishes bigger pieces, not
  more of them (more would make each round longer, and the lag with it);
- every other job's every checkpoint_interval_s (what a crash costs: the next run generates them
  again), and in any case once MAX_EVENT_TOKENS wait.

What a streamed token's delay holds to: its job's next slot comes at most a share after the job's
last publication, which came a step or more before the token was sampled; then the loop's first
iteration past the slot, and delivery (a round still out, its own round, a reader's read). With
every slot streamed the bound leaves those about a step: it holds while rounds take well under a
step (a GPU's at 12 ms steps: 3-4 ms for 256 publications; a slot taken an iteration later than the
one before can bring a token up to a round past it); fewer streams leave stream_interval_s - share
of slack besides. A worker whose rounds take longer (its host saturated) brings tokens to readers
within a share plus that iteration and delivery.

Every running job hears from its hash (its cancel flag, its run, whether a reader follows it) at
least as often as its tokens go out, every stream_interval_s or checkpoint_interval_s: with each
publication (PUBLISH answers it), else by a look (HMGET). So a cancel stops a streamed job within
stream_interval_s and any other within checkpoint_interval_s, and a reader that starts following
a job is noticed within checkpoint_interval_s. An unstreamed job whose look comes due with output
waiting publishes it instead, its checkpoint that much early: its output started waiting after its
last publication (a step after it, for a job that generates), so its own checkpoint would come
that much after its look, which would be one command more a checkpoint for what the publication
answers.

While no running job is streamed, the iterations between due times ask nothing of the jobs: the
last pass over them knew the oldest time one was heard from (so when the next checkpoint or look
comes) and the most tokens one had waiting (so how many more bring one to MAX_EVENT_TOKENS, each
step's most for one job told by the collection). What it could not know wakes the pace (the next
plan passes over every job): a job started (its look may be overdue: a suspect tried again), a
run's first output (due at once), a job turned streamed, a look the loop could not send (due
again). A cancel, a job's end or its lost run change nothing here: they are learnt from, or go
out with, the rounds these plans make."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection

from worker.loop.jobs import Feed, Job

# One tokens event holds about this many tokens at most: a reader's reply and the script's
# arguments stay small whatever the checkpoint interval and the engine's speed.
MAX_EVENT_TOKENS = 1024
# The lag counts on the slowest of this many recent iterations and rounds: one slow iteration (a
# long step, the machine busy elsewhere) is a sign of more, not a thing of the past.
LAG_WINDOW = 64


class Pace:
    def __init__(self, stream_interval_s: float, checkpoint_interval_s: float, max_running: int):
        self.stream_interval_s = stream_interval_s
        self.checkpoint_interval_s = checkpoint_interval_s
        self.max_running = max_running
        self.iterations: deque[float] = deque(maxlen=LAG_WINDOW)
        self.rounds: deque[float] = deque(maxlen=LAG_WINDOW)
        # How long a publication decided now may take to reach readers: the loop's next iteration
        # (a due job is seen after a step at the latest), a round still out before it, its own
        # round, and about as long again for a reader's blocked read to return it.
        self.lag_s = 0.0
        # Between due times the pass over every running job is skipped (bench/RESULTS.md, y/pub6):
        # while no job is streamed, none comes due before the oldest time a job was last heard from
        # (or its output started waiting) plus checkpoint_interval_s, nor before the job whose
        # output waits longest could hold MAX_EVENT_TOKENS, unless something the pass did not see
        # happens: a job starts, a run's first output, a job turns streamed, a look not taken
        # (wake). -inf: the next plan passes over every job.
        self.heard_at = -math.inf  # monotonic: the oldest hearing of the jobs not due, at the last pass
        self.room = 0  # tokens any job may add before one of them holds MAX_EVENT_TOKENS waiting

    def measured(self, iteration_s: float, round_s: float | None) -> None:
        self.iterations.append(iteration_s)
        if round_s is not None:
            self.rounds.append(round_s)
        self.lag_s = max(self.iterations) + 3 * max(self.rounds, default=0.0)

    def wake(self) -> None:
        """Something the last pass did not see may have made a job due: the next plan passes over
        every job (a job started, a job turned streamed, a look the loop could not send)."""
        self.heard_at = -math.inf

    def collected(self, most: int, first: bool) -> None:
        """An engine step added at most `most` tokens to any one job; `first`: a run's first output
        is among them (due at once)."""
        self.room -= most
        if first:
            self.heard_at = -math.inf

    def plan(self, jobs: Collection[Job], now: float) -> tuple[list[Job], list[Job]]:
        """(the jobs whose output is due now, the jobs due for a look at their hash). While no job
        is streamed and none can be due (see wake), nothing is asked of the jobs; otherwise every
        running job is asked: whether its output is due is tested in the loop itself, not by a
        method call a job. The streams, which set a streamed job's share, are counted (a pass over
        every job) only once a streamed job is met: a worker of jobs read whole never counts."""
        horizon = now - self.checkpoint_interval_s  # a job read whole last heard of before it is due
        if self.heard_at > horizon and self.room > 0:
            return [], []
        share = patience = -1.0  # not counted yet
        publish, look = [], []
        heard = now  # a job due now is heard from now: its publication, or its look (else wake)
        most = 0  # the most tokens waiting in a job not due
        for job in jobs:
            feed = job.feed
            since = feed.waiting_since
            if feed.streamed:
                if share < 0:
                    share = self._share(jobs)
                    patience = share - self.lag_s
                if since is not None and (
                    feed.tokens == job.resumed_tokens
                    or len(job.token_ids) - feed.tokens >= MAX_EVENT_TOKENS
                    or (now - since >= patience and now >= feed.next_slot)
                ):
                    publish.append(job)
                    take_slot(feed, share, now)
                elif now - feed.looked_at >= self.stream_interval_s:
                    look.append(job)
                continue
            # Its checkpoint, or its look: output waiting goes out once either is due. A job not
            # due is most jobs of most iterations, each test made once (the look's in the branch
            # it decides, not kept in a name for the other), and compared with the horizon, not
            # subtracted from now (a float made per job and test).
            looked_at = feed.looked_at
            if since is None:
                if looked_at <= horizon:
                    look.append(job)
                elif looked_at < heard:
                    heard = looked_at
                continue
            waiting = len(job.token_ids) - feed.tokens
            if (
                since <= horizon
                or looked_at <= horizon
                or feed.tokens == job.resumed_tokens
                or waiting >= MAX_EVENT_TOKENS
            ):
                publish.append(job)
                continue
            if looked_at < heard:
                heard = looked_at
            if since < heard:
                heard = since
            if waiting > most:
                most = waiting
        # A streamed job is asked every iteration: its slots come a share apart.
        self.heard_at = heard if share < 0 else -math.inf
        self.room = MAX_EVENT_TOKENS - most
        return publish, look

    def _share(self, jobs: Collection[Job]) -> float:
        """A streamed job's share of stream_interval_s: its slots' spacing."""
        streams = sum([job.feed.streamed for job in jobs])
        return self.stream_interval_s * min(1.0, streams / self.max_running)


def take_slot(feed: Feed, share: float, now: float) -> None:
    """A streamed job publishes now: its next slot is a share after this one's. Its slots keep their
    step while it publishes within a share of each (a publication a loop iteration late does not
    push the next one later); one that has waited longer (a quiet job, its first tokens) starts
    them anew from now."""
    following = feed.next_slot + share
    feed.next_slot = following if now < following else now + share
