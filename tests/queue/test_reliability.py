"""Reliability of the queue loop, in this process on the echo engine against a real redis-server:
ownership and reclaim, resume from recorded tokens, fencing of a stalled worker, poison entries,
deadlines of reclaimed jobs, a Redis outage, a failing engine step, and the hand-over at the end
of a drain. A "ghost" is a worker that took an entry and died: the test plays its part by hand."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid

import pytest

from harness.echo_workers import SlowEchoEngine, outcome_count, serving
from harness.polling import eventually
from producer_client import JobExpired, JobFailed
from producer_client.keys import CANCELLED_TTL_S, GROUP, PROTOCOL_VERSION, Keys
from producer_client.protocol.execution import execute
from producer_client.protocol.script import job_keys
from producer_client.protocol.worker import CLAIM, PUBLISH, RELEASE, WORKER_SCRIPTS
from producer_client.schema import JobRequest
from tests.support.clients import make_client
from tests.support.jobs import assert_one_final_result, events, runs, tokens_published
from worker.loop.outbox import Update

pytestmark = pytest.mark.waits

KEYS = Keys()
# Small enough for quick tests, and ten heartbeats of `serving` (0.05 s): a busy machine that
# starves a worker thread for a moment must not make it look dead.
FAST_RECLAIM = dict(claim_idle_ms=500, reclaim_interval_s=0.05)


@pytest.fixture
def client(redis_server, queue):
    c = make_client("sync", redis_server.url, queue)
    yield c
    c.close()


def ghost_takes(redis_client, queue, prompt: str, published: int, **job) -> str:
    """A job whose worker read it, published the echo of its first `published` bytes, and died."""
    stream = KEYS.queue(queue)
    if not redis_client.exists(stream):
        redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
    job_id = uuid.uuid4().hex
    body = JobRequest(prompt=prompt, **job).to_json()
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    redis_client.xadd(stream, {"id": job_id, "v": PROTOCOL_VERSION, "body": body})
    ((_, [(entry_id, _)]),) = redis_client.xreadgroup(GROUP, "ghost", {stream: ">"}, count=1)

    def call(script, *args):
        def add(pipe):
            pipe.evalsha(script.sha, 3, *job_keys(KEYS, job_id), *args)

        return execute(redis_client, add, WORKER_SCRIPTS)[0]

    call(CLAIM, "ghost", entry_id, 60, "ghost-run")
    start = json.dumps({"worker": "ghost", "started_at": time.time() - 1, "resumed_tokens": 0})
    for i in range(published):
        step = json.dumps({"ids": [ord(prompt[i])], "text": prompt[i]})
        call(PUBLISH, "ghost-run", start if i == 0 else "", step, i, i + 1, "", "", 60)
    return job_id


def taken_lines(caplog) -> list[str]:
    """What the worker logged as it took entries others held."""
    return [r.getMessage() for r in caplog.records if r.name == "worker.loop.admission" and "entries" in r.getMessage()]


def test_a_reclaimed_job_resumes_after_its_recorded_tokens(redis_server, redis_client, client, queue):
    prompt = "resume me from where the dead worker stopped"
    job_id = ghost_takes(redis_client, queue, prompt, published=7, params={"max_tokens": 100})
    with serving(redis_server.url, queue, **FAST_RECLAIM) as worker:
        result = client.result(job_id, timeout=10)
        assert eventually(lambda: outcome_count(worker, "done") == 1)
    assert (result.status, result.text, result.worker) == ("done", prompt, worker.name)
    assert tokens_published(redis_client, job_id) == list(prompt.encode())  # no token published twice
    starts = [start for start, _ in runs(redis_client, job_id)]
    assert [(s["worker"], s["resumed_tokens"]) for s in starts] == [("ghost", 0), (worker.name, 7)]
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (len(prompt), len(prompt))
    assert result.timings.started_at == pytest.approx(starts[0]["started_at"])  # the job's start, not this run's
    assert_one_final_result(redis_client, job_id)
    assert redis_client.xlen(KEYS.queue(queue)) == 0


@pytest.mark.timing
def test_a_worker_takes_only_handed_over_entries_in_its_first_claim_idle_ms(
    redis_server, redis_client, client, queue, caplog
):
    # An entry idle for a while may be a live worker's that could not refresh it yet (Redis has
    # just come back); one a drain handed over is free at once.
    stale = ghost_takes(redis_client, queue, "stale", published=0)
    handed = ghost_takes(redis_client, queue, "handed over", published=0)
    stream = KEYS.queue(queue)
    pending = {r["message_id"]: r for r in redis_client.xpending_range(stream, GROUP, "-", "+", 10)}
    stale_entry, handed_entry = sorted(pending)
    redis_client.xclaim(stream, GROUP, "ghost", 0, [stale_entry], idle=10_000, justid=True)
    execute(
        redis_client,
        lambda pipe: pipe.evalsha(RELEASE.sha, 1, stream, GROUP, "ghost", 10**10, handed_entry),
        WORKER_SCRIPTS,
    )
    started = time.time()
    with (
        caplog.at_level(logging.INFO, logger="worker.loop.admission"),
        serving(redis_server.url, queue, claim_idle_ms=1000, reclaim_interval_s=0.05),
    ):
        assert client.result(handed, timeout=10).text == "handed over"
        assert client.result(stale, timeout=10).text == "stale"
    # Each says how it was taken: not "idle over 1000 ms" for the entry handed over a moment ago.
    assert taken_lines(caplog) == [
        f"took over 1 entries that a draining worker handed over: {handed} (delivery 1)",
        f"reclaimed 1 entries idle over 1000 ms: {stale} (delivery 2)",
    ]
    ((handed_run, _),) = runs(redis_client, handed)
    ((stale_run, _),) = runs(redis_client, stale)
    assert handed_run["at"] - started < 0.5
    assert stale_run["at"] - started >= 0.95


def test_a_live_workers_long_job_is_never_reclaimed(redis_server, redis_client, client, queue):
    # Each step takes 10 ms and the job 200 steps: four times claim_idle_ms, while an idle second
    # worker looks for idle entries every 50 ms.
    with serving(redis_server.url, queue, step_s=0.01, name=f"a-{queue}", **FAST_RECLAIM) as a:
        job_id = client.submit("z" * 200, max_tokens=200)
        next(iter(client.stream(job_id, timeout=10)))
        with serving(redis_server.url, queue, name=f"b-{queue}", **FAST_RECLAIM):
            result = client.result(job_id, timeout=20)
    assert (result.status, result.worker, result.text) == ("done", a.name, "z" * 200)
    assert len(runs(redis_client, job_id)) == 1
    assert tokens_published(redis_client, job_id) == list(b"z" * 200)


class StallingEchoEngine(SlowEchoEngine):
    """Echo whose 20th step takes a whole second: long enough to lose its job to a reclaim."""

    def step(self):
        if self._steps == 19:
            time.sleep(1.0)
        return super().step()


def test_a_stalled_worker_is_fenced_off_and_the_job_ends_once(redis_server, redis_client, client, queue):
    with serving(
        redis_server.url, queue, step_s=0.005, engine_class=StallingEchoEngine, name=f"a-{queue}", **FAST_RECLAIM
    ) as stalled:
        job_id = client.submit("s" * 100, max_tokens=100)
        next(iter(client.stream(job_id, timeout=10)))
        with serving(redis_server.url, queue, step_s=0.005, name=f"b-{queue}", **FAST_RECLAIM) as rescuer:
            result = client.result(job_id, timeout=20)
            assert eventually(lambda: not stalled.holdings.running)  # the stalled run learnt it lost the job
    assert (result.status, result.worker, result.text) == ("done", rescuer.name, "s" * 100)
    # What the stalled worker made after the reclaim never reached the stream: each token once.
    assert tokens_published(redis_client, job_id) == list(b"s" * 100)
    assert_one_final_result(redis_client, job_id)
    assert redis_client.xlen(KEYS.queue(queue)) == 0


def test_an_entry_delivered_too_often_goes_to_the_dead_letter_stream(redis_server, redis_client, client, queue):
    job_id = ghost_takes(redis_client, queue, "poison", published=2)
    stream = KEYS.queue(queue)
    (entry,) = redis_client.xpending_range(stream, GROUP, "-", "+", 1)
    # Two more workers took it and died: three deliveries, the most max_deliveries=3 allows.
    redis_client.xclaim(stream, GROUP, "ghost", 0, [entry["message_id"]], retrycount=3)
    with serving(redis_server.url, queue, max_deliveries=3, **FAST_RECLAIM) as worker:
        with pytest.raises(JobFailed) as e:
            client.result(job_id, timeout=10)
        assert eventually(lambda: outcome_count(worker, "dead_lettered") == 1)
        assert outcome_count(worker, "failed") == 0
    assert e.value.code == "poison"
    assert "delivered 4 times, more than max_deliveries 3" in e.value.message
    ((_, letter),) = redis_client.xrange(KEYS.dead(queue))
    assert (letter["id"], letter["entry"], letter["deliveries"], letter["worker"]) == (
        job_id,
        entry["message_id"],
        "4",
        worker.name,
    )
    assert letter["reason"] == e.value.message and json.loads(letter["body"])["prompt"] == "poison"
    assert redis_client.xlen(stream) == 0 and redis_client.xpending(stream, GROUP)["pending"] == 0
    assert redis_client.hget(KEYS.job(job_id), "tokens") == "2"  # the recorded tokens stay
    # Its failed result holds what the earlier run made, as its event stream does: a reader that
    # streamed "po" is not told at the end that the job made nothing (bench.chaos seeds 6328-6353).
    failed = client.status(job_id).result
    assert (failed.status, failed.token_ids, failed.text) == ("failed", list(b"po"), "po")
    assert tokens_published(redis_client, job_id) == list(b"po")
    assert_one_final_result(redis_client, job_id)


def test_a_reclaimed_job_past_its_deadline_ends_with_its_recorded_tokens(redis_server, redis_client, client, queue):
    started = ghost_takes(redis_client, queue, "deadline", published=3, timeout_s=0.2)
    never_started = ghost_takes(redis_client, queue, "too late", published=0, timeout_s=0.2)
    time.sleep(0.3)
    with serving(redis_server.url, queue, **FAST_RECLAIM):
        partial = client.result(started, timeout=10)
        with pytest.raises(JobExpired):
            client.result(never_started, timeout=10)
        assert eventually(lambda: client.status(never_started).result is not None)
        expired = client.status(never_started).result
    assert (partial.status, partial.finish_reason, partial.text, partial.usage.completion_tokens) == (
        "done",
        "timeout",
        "dea",
        3,
    )
    assert (expired.status, expired.text) == ("expired", "")


class FailingEchoEngine(SlowEchoEngine):
    """Echo whose step raises whenever it would produce the 4th token of a prompt that starts with
    "boom": a fault tied to one job's position, whatever batch it is in."""

    def _emit_next(self, req):
        if req.prompt[:4] == list(b"boom") and req.emitted >= 3:
            raise RuntimeError("injected fault")
        return super()._emit_next(req)


def test_a_failing_engine_step_fails_only_the_job_that_makes_it_fail(redis_server, client, queue):
    with serving(redis_server.url, queue, step_s=0.002, engine_class=FailingEchoEngine) as worker:
        good = [client.submit(f"good job {i} " * 4, max_tokens=60) for i in range(3)]
        boom = client.submit("boom" * 10, max_tokens=40)
        with pytest.raises(JobFailed) as e:
            client.result(boom, timeout=10)
        results = [client.result(job_id, timeout=10) for job_id in good]
        after = client.generate("still serving", max_tokens=20, timeout=10)
        assert worker.thread.is_alive()
    assert e.value.code == "engine_error" and "injected fault" in e.value.message
    assert e.value.result.text == "boo" and e.value.result.usage.completion_tokens == 3
    assert [r.text for r in results] == [f"good job {i} " * 4 for i in range(3)]
    assert after.text == "still serving"


def largest_tokens_event(redis_client, job_id: str) -> int:
    """How many tokens the job's largest tokens event carried."""
    return max(len(data["ids"]) for _, kind, data in events(redis_client, job_id) if kind == "tokens")


def test_a_redis_outage_buffers_events_and_flushes_them_after(restartable_redis, redis_client_of, queue):
    redis_client = redis_client_of(restartable_redis)
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        serving(restartable_redis.url, queue, step_s=0.01, max_buffered_tokens=1000) as worker,
    ):
        job_id = client.submit("o" * 300, max_tokens=300)
        next(iter(client.stream(job_id, timeout=10)))
        restartable_redis.restart(down_s=1.0)
        result = client.result(job_id, timeout=20)
        assert worker.thread.is_alive()
    assert result.text == "o" * 300
    assert tokens_published(redis_client, job_id) == list(b"o" * 300)
    # Generation went on while Redis was down: one event carries what the outage held back.
    assert largest_tokens_event(redis_client, job_id) > 20
    assert_one_final_result(redis_client, job_id)


def test_generation_pauses_when_the_outbox_is_full(restartable_redis, redis_client_of, queue):
    redis_client = redis_client_of(restartable_redis)
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        serving(restartable_redis.url, queue, step_s=0.005, max_buffered_tokens=15) as worker,
    ):
        job_id = client.submit("p" * 200, max_tokens=200)
        next(iter(client.stream(job_id, timeout=10)))
        restartable_redis.stop()
        assert eventually(lambda: worker.paused, timeout=10)
        steps = worker.engine._steps
        time.sleep(0.3)
        assert worker.engine._steps == steps  # paused: no step while the outbox is full
        restartable_redis.start()
        result = client.result(job_id, timeout=20)
    assert result.text == "p" * 200
    assert largest_tokens_event(redis_client, job_id) <= 15
    assert tokens_published(redis_client, job_id) == list(b"p" * 200)


def test_the_client_rides_out_a_redis_restart(restartable_redis, queue):
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        serving(restartable_redis.url, queue, step_s=0.01),
    ):
        job_id = client.submit("patience", max_tokens=100)
        waited = {}
        waiter = threading.Thread(target=lambda: waited.update(result=client.result(job_id, timeout=30)))
        waiter.start()
        time.sleep(0.05)
        restartable_redis.stop()
        time.sleep(0.5)
        threading.Timer(0.5, restartable_redis.start).start()
        second = client.submit("submitted while Redis was down", max_tokens=100)  # retried until it is back
        waiter.join(30)
        assert waited["result"].text == "patience"
        assert client.result(second, timeout=10).text == "submitted while Redis was down"


def test_a_drain_hands_unfinished_jobs_over_and_they_resume_at_once(redis_server, redis_client, client, queue, caplog):
    # claim_idle_ms is long: only the hand-over lets the second worker take the job this soon.
    slow = dict(claim_idle_ms=60_000, reclaim_interval_s=0.05)
    with serving(redis_server.url, queue, step_s=0.01, drain_grace_s=0.1, name=f"a-{queue}", **slow) as leaving:
        job_id = client.submit("h" * 200, max_tokens=200)
        next(iter(client.stream(job_id, timeout=10)))
        leaving.request_stop()
        leaving.wait_stopped()
    with (
        caplog.at_level(logging.INFO, logger="worker.loop.admission"),
        serving(redis_server.url, queue, step_s=0.002, name=f"b-{queue}", **slow) as staying,
    ):
        result = client.result(job_id, timeout=10)
    assert (result.text, result.worker) == ("h" * 200, staying.name)
    assert taken_lines(caplog) == [f"took over 1 entries that a draining worker handed over: {job_id} (delivery 1)"]
    (first, made), (second, _) = runs(redis_client, job_id)
    assert (first["worker"], second["worker"]) == (leaving.name, staying.name)
    assert second["resumed_tokens"] == len(made) > 0
    assert tokens_published(redis_client, job_id) == list(b"h" * 200)


def test_an_entry_whose_job_key_is_unusable_fails_its_job_and_the_worker_serves_on(
    redis_server,
    redis_client,
    client,
    queue,
):
    job_id = uuid.uuid4().hex
    redis_client.set(KEYS.job(job_id), "not a hash")  # a key of the wrong type: no script can run on it
    redis_client.xadd(KEYS.queue(queue), {"id": job_id, "v": PROTOCOL_VERSION, "body": '{"prompt": "x"}'})
    with serving(redis_server.url, queue) as worker:
        assert client.generate("next", max_tokens=8, timeout=10).text == "next"
        with pytest.raises(JobFailed) as failed:
            client.result(job_id, timeout=10)
        assert eventually(lambda: redis_client.xlen(KEYS.queue(queue)) == 0)
        assert worker.thread.is_alive()
    assert failed.value.code == "invalid_job" and "WRONGTYPE" in failed.value.message
    assert redis_client.xlen(KEYS.dead(queue)) == 0
    assert_one_final_result(redis_client, job_id)


def test_a_job_lost_and_taken_back_by_the_same_worker_runs_to_its_end(redis_server, redis_client, client, queue):
    # A ghost takes the job over (claims its entry and starts a run) and dies at once. The worker
    # learns it lost the job, aborts its copy, and reclaims the entry in the next iteration, before
    # the engine has reported that abort: the abort must not end the job's new admission.
    stream = KEYS.queue(queue)
    with serving(redis_server.url, queue, step_s=0.2, **FAST_RECLAIM) as worker:
        job_id = client.submit("t" * 10, max_tokens=10)
        next(iter(client.stream(job_id, timeout=10)))
        (entry,) = redis_client.xpending_range(stream, GROUP, "-", "+", 1)
        redis_client.xclaim(stream, GROUP, "ghost", 0, [entry["message_id"]], idle=10**9, justid=True)
        execute(
            redis_client,
            lambda pipe: pipe.evalsha(
                CLAIM.sha, 3, *job_keys(KEYS, job_id), "ghost", entry["message_id"], 60, "ghost-run"
            ),
            WORKER_SCRIPTS,
        )
        result = client.result(job_id, timeout=20)
    assert (result.status, result.text, result.worker) == ("done", "t" * 10, worker.name)
    assert tokens_published(redis_client, job_id) == list(b"t" * 10)
    assert [start["worker"] for start, _ in runs(redis_client, job_id)] == [worker.name, worker.name]


def test_an_update_skips_the_cuts_redis_recorded_from_a_call_whose_reply_was_lost():
    update = Update("job", "1-0", "r1", tokens_before=4)
    update.add_cut([1, 2], "ab", None)
    update.add_cut([3], "c", None)
    update.add_cut([4, 5], "de", None)
    assert not update.skip_recorded(5)  # not the end of a cut: not a call of ours
    assert update.skip_recorded(7)
    assert (update.tokens_before, update.token_ids, update.text, update.cut_sizes) == (7, [4, 5], ["de"], [2])
    assert update.publish_call(KEYS, 60).args[3:5] == (7, 9)  # tokens before, tokens after


def job_key_ttls_ms(redis_client, job_id: str) -> dict[str, int]:
    """PTTL of each of the job's keys (keys.py: hash, events, done): -2 where the key is gone. Not
    TTL, which rounds: a done stream in the last half second of its DONE_TTL_MS reads 0 there."""
    return {key: redis_client.pttl(key) for key in job_keys(KEYS, job_id)}


def test_every_ended_jobs_keys_expire_however_it_ended(redis_server, redis_client, client, queue):
    # A job ends five ways: cancelled queued (here with no worker reading its entry yet: a
    # queue nobody serves, or one behind a backlog), cancelled running, failed at its claim (a key
    # of another type), dead-lettered, past its deadline. None may leave a key that stays.
    result_ttl_s = 300
    dead_lettered = ghost_takes(redis_client, queue, "poison", published=2)  # first: the ghost reads the first entry
    (entry,) = redis_client.xpending_range(KEYS.queue(queue), GROUP, "-", "+", 1)
    redis_client.xclaim(KEYS.queue(queue), GROUP, "ghost", 0, [entry["message_id"]], retrycount=3)
    cancelled_queued = client.submit("never read", max_tokens=4)
    client.cancel(cancelled_queued)
    ttls = job_key_ttls_ms(redis_client, cancelled_queued)
    assert all(ttl == -2 or 0 < ttl <= 1000 * CANCELLED_TTL_S for ttl in ttls.values()), ttls
    expired = client.submit("too late", max_tokens=4, timeout_s=0.2)
    failed_at_claim = uuid.uuid4().hex
    redis_client.set(KEYS.events(failed_at_claim), "not a stream")  # CLAIM refuses it: the job fails
    redis_client.xadd(KEYS.queue(queue), {"id": failed_at_claim, "v": PROTOCOL_VERSION, "body": '{"prompt": "x"}'})
    time.sleep(0.3)
    with serving(redis_server.url, queue, step_s=0.05, max_deliveries=3, result_ttl_s=result_ttl_s, **FAST_RECLAIM):
        cancelled_running = client.submit("a long one " * 10, max_tokens=100)
        assert eventually(lambda: client.status(cancelled_running).status == "running")
        client.cancel(cancelled_running)
        ended = [cancelled_queued, cancelled_running, failed_at_claim, dead_lettered, expired]
        for job_id in ended:
            assert eventually(lambda job_id=job_id: redis_client.hexists(KEYS.job(job_id), "result"), timeout=10)
        assert eventually(lambda: redis_client.xlen(KEYS.queue(queue)) == 0)
    statuses = [client.status(job_id).status for job_id in ended]
    assert statuses == ["cancelled", "cancelled", "failed", "failed", "expired"]
    for job_id in ended:
        ttls = job_key_ttls_ms(redis_client, job_id)
        assert all(ttl == -2 or 0 < ttl <= 1000 * result_ttl_s for ttl in ttls.values()), (job_id, ttls)
        assert 0 < ttls[KEYS.job(job_id)] <= 1000 * result_ttl_s
