"""The pace of publication (worker/loop/pace.py), on simulated steps: a streamed job publishes at
most once in each share of stream_interval_s, however far behind the loop falls (a lagging worker
publishes bigger pieces, not more of them), its slots keep their step when a publication comes a
step late, and a worker that keeps pace still publishes each token within the bound.

Times are multiples of 1/128 s, exact in binary, so a slot is reached at an exact step."""

from types import SimpleNamespace

from producer_client.schema import JobRequest
from worker.engine.outputs import RequestOutput, TokenCounts
from worker.loop.collection import Collector
from worker.loop.holdings import Holdings
from worker.loop.jobs import AdmissionId, Job
from worker.loop.pace import Pace

STEP = 1 / 128
INTERVAL = 8 * STEP  # stream_interval_s: eight steps
START = 100.0  # a monotonic clock's time: far from 0


def streamed_job(i: int) -> Job:
    request = JobRequest.model_validate({"prompt": "hi", "stream": True})
    return Job(f"j{i}", f"{i}-0", "r1", request, [1, 2], queued_at=0.0, started_at=0.0)


def run(
    pace: Pace, jobs: list[Job], steps: int, idle: frozenset[int] = frozenset(), busy: frozenset[int] = frozenset()
):
    """Each step samples a token for every job (none on `idle` steps), then asks the pace, as the
    loop does after a step (not on `busy` steps: a round is still out). Returns, per job, the steps
    it published at, the size of each piece, and each token's wait from its sampling to its piece."""
    published: dict[str, list[int]] = {job.id: [] for job in jobs}
    pieces: dict[str, list[int]] = {job.id: [] for job in jobs}
    waits: list[float] = []
    sampled: dict[str, list[float]] = {job.id: [] for job in jobs}
    for k in range(steps):
        now = START + k * STEP
        if k not in idle:
            for job in jobs:
                job.token_ids.append(k)
                sampled[job.id].append(now)
                if job.feed.waiting_since is None:
                    job.feed.waiting_since = now
        if k in busy:
            continue
        due, _ = pace.plan(jobs, now)
        for job in due:
            published[job.id].append(k)
            pieces[job.id].append(len(job.token_ids) - job.feed.tokens)
            waits += [now - at for at in sampled[job.id][job.feed.tokens :]]
            job.feed.catch_up(job)
    return published, pieces, waits


def lagging(pace: Pace) -> Pace:
    """The loop has fallen far behind: its lag is past the interval, patience is gone."""
    pace.measured(0.5, 0.2)
    return pace


def test_a_lagging_worker_publishes_a_streamed_job_once_a_share_in_bigger_pieces():
    jobs = [streamed_job(i) for i in range(4)]
    pace = lagging(Pace(INTERVAL, 1.0, max_running=4))
    published, pieces, _ = run(pace, jobs, 320)  # 2.5 s: 40 intervals
    for job in jobs:
        # Its first token at once, then one piece of a share's eight tokens per slot: 40 in 2.5 s,
        # max_running / stream_interval_s a second for the worker (the lag would have made it 320).
        assert published[job.id] == list(range(0, 320, 8))
        assert pieces[job.id] == [1] + [8] * 39


def test_fewer_streams_than_slots_publish_in_proportionally_shorter_shares():
    jobs = [streamed_job(i) for i in range(2)]
    pace = lagging(Pace(INTERVAL, 1.0, max_running=8))  # a share: 2 of 8 slots, an interval's quarter
    published, pieces, _ = run(pace, jobs, 64)
    for job in jobs:
        assert published[job.id] == list(range(0, 64, 2))
        assert pieces[job.id] == [1] + [2] * 31


def test_the_streams_among_jobs_read_whole_share_the_interval_by_their_own_count():
    """The share counts the streamed jobs of the whole plan, those met before the first streamed job
    too (the jobs read whole come first here); the jobs read whole keep their checkpoints."""
    whole = [unstreamed_job(i, START) for i in range(6)]
    streams = [streamed_job(i) for i in range(2)]
    pace = lagging(Pace(INTERVAL, 1.0, max_running=8))  # a share: 2 of 8 slots, an interval's quarter
    published, pieces, _ = run(pace, [*whole, *streams], 64)  # half a checkpoint
    for job in streams:
        assert published[job.id] == list(range(0, 64, 2))
        assert pieces[job.id] == [1] + [2] * 31
    for job in whole:
        assert published[job.id] == [0]  # its first token at once, its checkpoint not yet due


def test_a_publication_a_step_late_does_not_push_the_next_slot_later():
    job = streamed_job(0)
    pace = lagging(Pace(INTERVAL, 1.0, max_running=1))
    published, _, _ = run(pace, [job], 33, busy=frozenset({8, 9}))  # step 8's slot taken at step 10
    assert published[job.id] == [0, 10, 16, 24, 32]


def test_a_job_quiet_for_longer_than_a_share_starts_its_slots_anew():
    job = streamed_job(0)
    pace = lagging(Pace(INTERVAL, 1.0, max_running=1))
    published, pieces, _ = run(pace, [job], 45, idle=frozenset(range(3, 28)))
    # Slots at 0 and 8 (tokens of steps 1-2); its slot of step 16 went by a share ago with nothing
    # to publish, so step 28's token goes out at once and the next slot is a share from there.
    assert published[job.id] == [0, 8, 28, 36, 44]
    assert pieces[job.id] == [1, 2, 1, 8, 8]


def test_a_worker_that_keeps_pace_publishes_every_token_within_the_bound():
    jobs = [streamed_job(i) for i in range(4)]
    pace = Pace(INTERVAL, 1.0, max_running=4)
    pace.measured(STEP, STEP / 4)  # a loop iteration a step, rounds of a quarter step: lag 1.75 steps
    published, _, waits = run(pace, jobs, 160)
    # The slots rule: a token waits at most a share less the step before its sampling; with
    # delivery (the lag) under a step, it reaches readers within the interval.
    assert max(waits) == INTERVAL - STEP
    assert all(len(steps) == 20 for steps in published.values())


def unstreamed_job(i: int, at: float) -> Job:
    request = JobRequest.model_validate({"prompt": "hi"})
    job = Job(f"u{i}", f"{i}-0", "r1", request, [1, 2], queued_at=0.0, started_at=0.0)
    job.feed.looked_at = at  # its claim read its hash
    return job


def hearings(pace: Pace, job: Job, steps: int, idle: frozenset[int] = frozenset()) -> tuple[list[int], list[int]]:
    """The steps at which the job published and at which it was looked at, its output sampled each
    step but `idle` ones, each publication and look telling the job what its hash holds (looked_at),
    as the loop's Publication does."""
    published, looked = [], []
    for k in range(steps):
        now = START + k * STEP
        if k not in idle:
            job.token_ids.append(k)
            if job.feed.waiting_since is None:
                job.feed.waiting_since = now
        due, look = pace.plan([job], now)
        for j in due:
            published.append(k)
            j.feed.catch_up(j)
            j.feed.waiting_since = None
            j.feed.looked_at = now
        for j in look:
            looked.append(k)
            j.feed.looked_at = now
    return published, looked


CHECKPOINT = 32 * STEP  # checkpoint_interval_s: 32 steps


def test_an_unstreamed_job_that_generates_is_heard_from_by_its_publications_alone_once_a_checkpoint():
    """Its output waits from the step after each publication, so its checkpoint falls a step after
    its look would: the look's answer comes with the publication instead, at the look's time."""
    job = unstreamed_job(0, START)
    published, looked = hearings(Pace(INTERVAL, CHECKPOINT, max_running=4), job, 160)
    assert published == [0, 32, 64, 96, 128]  # its first token at once, then one piece a checkpoint
    assert looked == []


def test_a_quiet_unstreamed_job_is_looked_at_once_a_checkpoint_and_publishes_its_next_output_at_its_look():
    job = unstreamed_job(0, START)
    # Steps 1-70 sample nothing (a long prefill of another job, a paused request): the job is
    # looked at instead; step 71's token goes out at the look due at step 96, 25 steps later.
    published, looked = hearings(Pace(INTERVAL, CHECKPOINT, max_running=4), job, 130, idle=frozenset(range(1, 71)))
    assert looked == [32, 64]
    assert published == [0, 96, 128]


class Asked:
    """The running jobs as the plan gets them, counting its passes over them."""

    def __init__(self, jobs: list[Job]):
        self.jobs = jobs
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return iter(self.jobs)

    def __len__(self):
        return len(self.jobs)

    def __contains__(self, job):
        return job in self.jobs


def generate(jobs: list[Job], now: float, tokens: int = 1) -> None:
    """A step's output for each job, as the collection adds it."""
    for job in jobs:
        job.token_ids += [0] * tokens
        if job.feed.waiting_since is None:
            job.feed.waiting_since = now


def heard(due: list[Job], look: list[Job], now: float) -> None:
    """What the loop's Publication does with a plan: publications and looks answer for the jobs."""
    for job in due:
        job.feed.catch_up(job)
        job.feed.looked_at = now
    for job in look:
        job.feed.looked_at = now


def test_between_due_times_a_pace_of_jobs_read_whole_passes_over_none_of_them():
    """Its checkpoints and looks come due at times the last pass knew: the iterations in between ask
    nothing of the running jobs (a pass over max_running of them was 12% of a whole-read token's
    loop, bench/RESULTS.md y/pub5)."""
    jobs = [unstreamed_job(i, START) for i in range(4)]
    running = Asked(jobs)
    pace = Pace(INTERVAL, CHECKPOINT, max_running=4)
    published = []
    for k in range(70):
        now = START + k * STEP
        generate(jobs, now)
        pace.collected(1, first=k == 0)  # step 0: each run's first output
        due, look = pace.plan(running, now)
        heard(due, look, now)
        if due:
            published.append(k)
    assert published == [0, 32, 64]  # the first tokens at once, then one piece a checkpoint
    assert running.passes == 3


def quiet_pace(jobs: list[Job]) -> Pace:
    """A pace whose jobs read whole published their first tokens at START: nothing due for a
    checkpoint."""
    pace = Pace(INTERVAL, CHECKPOINT, max_running=8)
    generate(jobs, START)
    heard(*pace.plan(jobs, START), START)
    return pace


def test_a_runs_first_output_between_due_times_is_published_at_once():
    """The collection tells the pace of a run's first output (a job started since the last pass):
    it goes out with the iteration's round, not at the others' checkpoint."""
    jobs = [unstreamed_job(0, START)]
    pace = quiet_pace(jobs)
    new = unstreamed_job(1, START + STEP)
    jobs.append(new)
    pace.wake()  # it started (Publication.publish hears of each start)
    assert pace.plan(jobs, START + STEP) == ([], [])
    generate([new], START + 2 * STEP)
    pace.collected(1, first=True)
    assert pace.plan(jobs, START + 2 * STEP) == ([new], [])


def test_a_job_started_between_due_times_is_looked_at_at_once_when_its_look_is_overdue():
    """A suspect tried again alone (worker/loop/isolation.py) was last heard from long ago: its look
    is due as it starts, before any output."""
    jobs = [unstreamed_job(0, START)]
    pace = quiet_pace(jobs)
    suspect = unstreamed_job(1, START - 2 * CHECKPOINT)
    jobs.append(suspect)
    pace.wake()
    assert pace.plan(jobs, START + STEP) == ([], [suspect])


def test_a_job_whose_waiting_tokens_reach_an_events_bound_between_checkpoints_publishes_then():
    """MAX_EVENT_TOKENS waiting is due whatever the checkpoint: the collection tells the pace the
    most tokens a step gave one job, and the pass comes once a job may hold that many."""
    jobs = [unstreamed_job(i, START) for i in range(2)]
    pace = Pace(INTERVAL, 60.0, max_running=8)  # a checkpoint far off
    generate(jobs, START)
    heard(*pace.plan(jobs, START), START)
    published = []
    for k in range(1, 120):
        now = START + k * STEP
        generate(jobs[:1], now, tokens=10)  # one job gives 10 tokens a step, the other 1
        generate(jobs[1:], now)
        pace.collected(10, first=False)
        due, look = pace.plan(jobs, now)
        heard(due, look, now)
        published += [(k, job.id) for job in due]
    assert published == [(103, "u0")]  # 1,030 tokens waiting: the first step past MAX_EVENT_TOKENS


def test_a_job_turned_streamed_between_due_times_publishes_at_its_next_slot():
    """A reader's FOLLOW, seen by a look or a publication's answer (Publication._react), wakes the
    pace: a streamed job is asked every iteration."""
    jobs = [unstreamed_job(i, START) for i in range(2)]
    pace = quiet_pace(jobs)
    generate(jobs, START + STEP)
    assert pace.plan(jobs, START + STEP) == ([], [])
    jobs[1].feed.streamed = True
    pace.wake()
    due, _ = pace.plan(jobs, START + 2 * STEP)
    assert due == [jobs[1]]


class Told:
    """A pace that notes what the collection tells it."""

    def __init__(self):
        self.steps: list[tuple[int, bool]] = []

    def collected(self, most: int, first: bool) -> None:
        self.steps.append((most, first))


def test_the_collection_tells_the_pace_each_steps_most_tokens_for_one_job_and_a_runs_first_output():
    holdings = Holdings(SimpleNamespace(abort=lambda request_id: True))
    ctx = SimpleNamespace(
        holdings=holdings,
        clock=SimpleNamespace(now=lambda: 0.0),
        metrics=SimpleNamespace(generation_tokens=SimpleNamespace(inc=lambda n: None)),
        worker="w1",
    )
    pace = Told()
    collector = Collector(ctx, SimpleNamespace(probe=None), pace)
    jobs = [unstreamed_job(i, START) for i in range(2)]
    for job in jobs:
        job.engine_id = AdmissionId(job.id, 0)
        holdings.start(job)

    def step(*tokens: int) -> None:
        collector.collect(
            [
                RequestOutput(job.engine_id, [7] * n, "x" * n, False, None, TokenCounts(1, n, 0))
                for job, n in zip(jobs, tokens)
                if n
            ]
        )

    step(0, 0)  # a long prefill: nothing yet
    step(3, 0)  # the first job's first output (three tokens: a speculative step)
    step(1, 2)  # the second's first output
    step(1, 1)  # output waiting in both
    holdings.take_output(jobs[0])  # published: its output waits anew from the next step, not a run's first
    step(2, 1)
    assert pace.steps == [(0, False), (3, True), (2, True), (1, False), (2, False)]
