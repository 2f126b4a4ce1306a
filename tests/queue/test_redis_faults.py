"""The queue loop through Redis's real failure modes, in this process on the echo engine against
a real redis-server of the test's own: memory full, a read-only replica, the consumer group lost
(a flush, a restart without persistence), scripts flushed, connections killed. The worker stays
up, keeps its jobs and loses no token; and the unit rules behind that: which errors are
transient, how script replies are typed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import redis.exceptions as rex

from harness.echo_workers import GatedWorker, HoldingEchoEngine, outcome_count, serving
from harness.polling import eventually
from producer_client.keys import GROUP, Keys
from producer_client.protocol import execution
from producer_client.protocol.replies import Published, UnknownReply, parse_claim, parse_publish
from tests.support.clients import make_client
from tests.support.jobs import assert_one_final_result, runs, tokens_published
from worker.embedded_redis import free_port
from worker.loop import job_commands
from worker.loop.queue import GroupLost, RedisClock, is_transient

pytestmark = pytest.mark.waits

KEYS = Keys()


def alphabet(n: int, offset: int = 0) -> str:
    """A prompt whose every position shows: a token out of place changes the echo."""
    return "".join(chr(97 + (i + offset) % 26) for i in range(n))


@pytest.mark.parametrize(
    "error",
    [
        redis.ConnectionError("Connection closed by server."),
        redis.TimeoutError("Timeout reading from socket"),
        rex.BusyLoadingError("Redis is loading the dataset in memory"),
        rex.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),  # redis-py strips "OOM"
        rex.ReadOnlyError("You can't write against a read only replica."),  # and "READONLY"
        rex.TryAgainError("Multiple keys request during rehashing of slot"),
        rex.ClusterDownError("The cluster is down"),
        rex.MasterDownError("Link with MASTER is down and replica-serve-stale-data is set to 'no'."),
        redis.ResponseError("BUSY Redis is busy running a script."),
        redis.ResponseError("MISCONF Redis is configured to save RDB snapshots, but it's unable to persist"),
        redis.ResponseError("UNBLOCKED force unblock from blocking operation, instance state changed"),
        rex.NoScriptError("No matching script. Please use EVAL."),  # flushed again after the reload
    ],
    ids=lambda e: type(e).__name__ + ":" + str(e)[:12],
)
def test_redis_refusing_for_now_is_transient(error):
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        redis.AuthenticationError("invalid username-password pair or user is disabled."),
        rex.AuthorizationError("NOAUTH"),
        rex.NoPermissionError("this user has no permissions to run the 'xadd' command"),
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        GroupLost("NOGROUP No such key"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_errors_no_retry_mends_are_not_transient(error):
    assert not is_transient(error)


def test_script_replies_parse_into_their_outcomes_and_anything_else_is_unknown():
    assert parse_publish("partial:7").recorded == 7 and parse_publish("written").outcome is Published.WRITTEN
    claim = parse_claim(["claimed", 3, "1700000000123"])
    assert (claim.recorded_tokens, claim.deadline) == (3, 1700000000.123)
    for bad_publish in ("OK", "partial:x", "partial:-1", None, 1):
        with pytest.raises(UnknownReply):
            parse_publish(bad_publish)
    for bad_claim in (["claimed"], ["taken", 1], [], "claimed", ["claimed", "many"]):
        with pytest.raises(UnknownReply):
            parse_claim(bad_claim)


@pytest.fixture
def admin(restartable_redis, redis_client_of):
    return redis_client_of(restartable_redis)


def holding(url: str, queue: str, **settings):
    """An echo worker of 10 ms steps whose jobs are held (HoldingEchoEngine) until the test releases
    them: on a loaded machine a paced job alone could end before the fault it meets."""
    return serving(url, queue, step_s=0.01, engine_class=HoldingEchoEngine, **settings)


def running_job(client, prompt: str) -> str:
    job_id = client.submit(prompt, max_tokens=len(prompt))
    next(iter(client.stream(job_id, timeout=10)))
    return job_id


def assert_running(admin, client, job_id: str, prompt: str) -> None:
    """A test's precondition, checked rather than assumed: the job has neither ended nor published
    its whole output when the fault comes (else the test passes without meeting the fault)."""
    assert client.status(job_id).status == "running"
    assert len(tokens_published(admin, job_id)) < len(prompt)


def assert_whole_output_once(admin, client, job_id: str, prompt: str) -> None:
    result = client.result(job_id, timeout=30)
    assert (result.status, result.text) == ("done", prompt)
    assert tokens_published(admin, job_id) == list(prompt.encode())
    assert_one_final_result(admin, job_id)


def test_memory_full_pauses_publication_and_loses_nothing(restartable_redis, admin, queue):
    prompt = alphabet(300)
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        # Held until memory is full, then released: the tokens it makes from then on meet the
        # refusal, however long a loaded machine took to get here.
        holding(restartable_redis.url, queue) as worker,
    ):
        job_id = running_job(client, prompt)
        assert_running(admin, client, job_id, prompt)
        admin.config_set("maxmemory", 1)  # every write refused (noeviction), as with memory full
        worker.engine.release()
        time.sleep(1.0)
        refused_at = len(tokens_published(admin, job_id))
        assert refused_at <= HoldingEchoEngine.HOLD_AT  # none made since the refusal got in
        time.sleep(0.3)
        assert len(tokens_published(admin, job_id)) == refused_at  # nothing got in meanwhile
        admin.config_set("maxmemory", 0)
        assert_whole_output_once(admin, client, job_id, prompt)
        # The worker counts the job once PUBLISH's reply is back: after the client can see the result.
        assert eventually(lambda: outcome_count(worker, "done") == 1)
        assert worker.thread.is_alive()
    assert [start["worker"] for start, _ in runs(admin, job_id)] == [worker.name]  # never taken over


def test_a_read_only_window_is_ridden_out(restartable_redis, admin, queue):
    prompt = alphabet(300, offset=5)
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        # Held until the server is read-only, then released: its tokens meet the refusal.
        holding(restartable_redis.url, queue) as worker,
    ):
        job_id = running_job(client, prompt)
        assert_running(admin, client, job_id, prompt)
        admin.replicaof("127.0.0.1", free_port())  # a replica of a master that never answers: read-only
        worker.engine.release()
        time.sleep(1.0)
        admin.replicaof("NO", "ONE")
        assert_whole_output_once(admin, client, job_id, prompt)
        assert worker.thread.is_alive()
        assert client.generate("after", max_tokens=5, timeout=10).text == "after"


def test_a_read_only_window_longer_than_claim_idle_costs_no_worker_its_jobs(restartable_redis, admin, queue):
    # While the server is read-only, no worker can refresh its entries, so all of them look idle
    # afterwards: the first worker to get through must not take the others' jobs.
    prompt = alphabet(400)
    fast = dict(claim_idle_ms=500, reclaim_interval_s=0.05)
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        # The holder holds the job through the window: it is still running when b gets through.
        holding(restartable_redis.url, queue, name=f"a-{queue}", **fast) as holder,
    ):
        job_id = running_job(client, prompt)
        with serving(restartable_redis.url, queue, name=f"b-{queue}", **fast):
            assert_running(admin, client, job_id, prompt)
            admin.replicaof("127.0.0.1", free_port())
            time.sleep(1.5)  # three times claim_idle_ms
            admin.replicaof("NO", "ONE")
            holder.engine.release()
            assert_whole_output_once(admin, client, job_id, prompt)
    assert [start["worker"] for start, _ in runs(admin, job_id)] == [holder.name]


def test_a_worker_that_slept_through_a_redis_restart_takes_no_live_workers_job(restartable_redis, admin, queue):
    # Frozen while Redis restarted, the sleeper saw no outage; when it wakes, the live worker's
    # entry looks idle for as long as the outage lasted, until that worker has refreshed it.
    prompt = alphabet(400)
    fast = dict(claim_idle_ms=500, reclaim_interval_s=0.02, redis_backoff_max_s=0.4)
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        # The holder holds the job until the sleeper is awake: it is still running when the
        # sleeper could take it.
        holding(restartable_redis.url, queue, name=f"a-{queue}", **fast) as holder,
    ):
        job_id = running_job(client, prompt)
        with serving(restartable_redis.url, queue, name=f"b-{queue}", worker_class=GatedWorker, **fast) as sleeper:
            time.sleep(0.6)  # past the sleeper's first claim_idle_ms
            sleeper.gate.clear()
            assert_running(admin, client, job_id, prompt)
            restartable_redis.restart(down_s=0.7)
            sleeper.gate.set()
            holder.engine.release()
            assert_whole_output_once(admin, client, job_id, prompt)
    assert [start["worker"] for start, _ in runs(admin, job_id)] == [holder.name]


def test_entries_whose_claims_redis_refused_are_held_and_admitted_later(
    restartable_redis,
    admin,
    queue,
    monkeypatch,
):
    # Reads and XAUTOCLAIM go through while memory is full, CLAIM (it writes the job's hash) does
    # not: the entries a worker took then are its own, and it must neither forget them nor let
    # them look idle to the other workers.
    claim = job_commands.JobCommands.claim
    refuse_until = time.monotonic() + 3600

    def refused_for_a_while(self, jobs):
        if time.monotonic() < refuse_until:
            raise rex.OutOfMemoryError("command not allowed when used memory > 'maxmemory'.")
        return claim(self, jobs)

    monkeypatch.setattr(job_commands.JobCommands, "claim", refused_for_a_while)
    prompt = alphabet(150)
    fast = dict(claim_idle_ms=500, reclaim_interval_s=0.05)
    most: dict[str, int] = {}
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        serving(restartable_redis.url, queue, step_s=0.01, name=f"a-{queue}", **fast),
        serving(restartable_redis.url, queue, name=f"b-{queue}", **fast),
    ):
        time.sleep(2.0)  # Redis up long enough for reclaims to be allowed
        job_id = client.submit(prompt, max_tokens=len(prompt))
        refuse_until = time.monotonic() + 1.5  # three times claim_idle_ms
        # With placement the entry is in one worker's own stream: look at every stream of the queue.
        streams = [KEYS.queue(queue), *(KEYS.own_queue(queue, f"{w}-{queue}") for w in "ab")]
        while time.monotonic() < refuse_until:
            for stream in streams:
                for row in pending_rows(admin, stream):
                    most[row["consumer"]] = max(most.get(row["consumer"], 0), row["times_delivered"])
            time.sleep(0.02)
        assert_whole_output_once(admin, client, job_id, prompt)
    assert list(most.values()) == [1]  # read once, by one worker, never reclaimed
    assert len(runs(admin, job_id)) == 1


def pending_rows(admin, stream: str) -> list[dict]:
    """The stream's pending entries; none for a stream (or group) not created yet."""
    try:
        return admin.xpending_range(stream, GROUP, "-", "+", 10)
    except rex.ResponseError:
        return []


@pytest.mark.parametrize("lose", ["flushall", "restart_empty"])
def test_jobs_held_when_redis_loses_the_group_run_on_to_their_results(restartable_redis, admin, queue, lose):
    prompts = [alphabet(250, offset=i) for i in range(3)]
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        # The jobs are held until Redis has lost them: paced alone, one could end before the loss
        # on a loaded machine, and its result went with it (JobNotFound).
        holding(restartable_redis.url, queue) as worker,
    ):
        ids = [running_job(client, p) for p in prompts]
        # Producers already waiting for the results, as they would be.
        with ThreadPoolExecutor(len(ids)) as pool:
            waiting = [pool.submit(client.result, job_id, 30) for job_id in ids]
            time.sleep(0.1)
            if lose == "flushall":
                admin.flushall()
            else:
                restartable_redis.restart(down_s=0.5, keep_data=False)
            worker.engine.release()
            results = [w.result() for w in waiting]
        assert [(r.status, r.text) for r in results] == [("done", p) for p in prompts]
        # The group is back, and new jobs run as ever.
        assert client.generate("new", max_tokens=3, timeout=10).text == "new"
        assert worker.thread.is_alive()
        assert eventually(lambda: admin.xlen(KEYS.queue(queue)) == 0)
        assert admin.xpending(KEYS.queue(queue), GROUP)["pending"] == 0
    for job_id, prompt in zip(ids, prompts):
        # The worker wrote the job's whole output again: its event stream is complete, each token once.
        assert_whole_output_once(admin, client, job_id, prompt)
        assert [(s["worker"], s["resumed_tokens"]) for s, _ in runs(admin, job_id)] == [(worker.name, 0)]


def flush_after_a_round(worker, admin) -> None:
    """FLUSHALL from the worker's loop, once a round it sent has been answered and before the loop
    settles it: the next iteration's READ finds the group lost, and its publication sends another round."""
    publish, publisher, flushed = worker.publication.publish, worker.publication.publisher, threading.Event()

    def publish_then_flush() -> None:
        publish()
        if publisher.sending is not None and not flushed.is_set():
            with publisher.changed:
                publisher.changed.wait_for(lambda: publisher.sending is None)
            admin.flushall()
            flushed.set()

    worker.publication.publish = publish_then_flush
    assert flushed.wait(10)


def test_a_lost_group_a_read_finds_while_a_round_is_out_is_mended_and_its_jobs_adopted(restartable_redis, admin, queue):
    """A round is sent at every iteration (the intervals are shorter than a step), so that when an
    iteration's READ finds the group lost, a round is out when the next mends it, and settling
    that round reports the loss again (its job's hash is gone). The worker adopts its job all the
    same: it used to report the loss at each iteration and never mend it (seen at load in the
    drain test: 331 reports in 10 s, the job never adopted)."""
    prompt = alphabet(300)
    every_iteration = dict(stream_interval_s=0.001, checkpoint_interval_s=0.001)
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        holding(restartable_redis.url, queue, **every_iteration) as worker,
    ):
        job_id = running_job(client, prompt)
        flush_after_a_round(worker, admin)
        assert eventually(lambda: admin.hget(KEYS.job(job_id), "worker") == worker.name)  # adopted
        worker.engine.release()
        assert_whole_output_once(admin, client, job_id, prompt)
    assert [(s["worker"], s["resumed_tokens"]) for s, _ in runs(admin, job_id)] == [(worker.name, 0)]


def test_a_drain_gives_detached_jobs_back_to_the_queue(restartable_redis, admin, queue):
    # The leaving worker holds the job (HoldingEchoEngine, never released): on a paced echo alone, a
    # loaded machine let it end before the drain that gives it back (seen in CI at load 8).
    prompt = alphabet(300)
    with make_client("sync", restartable_redis.url, queue) as client:
        with holding(restartable_redis.url, queue, drain_grace_s=0.1, name=f"a-{queue}") as leaving:
            job_id = running_job(client, prompt)
            admin.flushall()
            assert eventually(lambda: admin.hget(KEYS.job(job_id), "worker") == leaving.name)  # adopted
            leaving.request_stop()
            leaving.wait_stopped()
        assert client.status(job_id).status == "queued"
        with serving(restartable_redis.url, queue, step_s=0.002, name=f"b-{queue}") as staying:
            assert_whole_output_once(admin, client, job_id, prompt)
    (first, made), (second, _) = runs(admin, job_id)
    assert (first["worker"], first["resumed_tokens"]) == (leaving.name, 0)
    assert (second["worker"], second["resumed_tokens"]) == (staying.name, len(made))


def test_scripts_flushed_and_connections_killed_mid_run_lose_nothing(restartable_redis, admin, queue):
    prompts = [alphabet(200, offset=i) for i in range(3)]
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        # Held until the first flush, then released: the jobs make their last 100 tokens (1 s at
        # least) while the flushes and kills go on, however long a loaded machine took to get here.
        holding(restartable_redis.url, queue) as worker,
    ):
        ids = [running_job(client, p) for p in prompts]
        for job_id, prompt in zip(ids, prompts):
            assert_running(admin, client, job_id, prompt)
        for _ in range(3):
            admin.script_flush()
            worker.engine.release()
            time.sleep(0.1)
            admin.client_kill_filter(_type="normal", skipme=True)
            time.sleep(0.1)
        for job_id, prompt in zip(ids, prompts):
            assert_whole_output_once(admin, client, job_id, prompt)
        assert worker.thread.is_alive()


def test_scripts_flushed_again_between_reload_and_resend_lose_nothing(restartable_redis, admin, queue, monkeypatch):
    """Two SCRIPT FLUSHes in a row can land on either side of the reload that follows a NOSCRIPT,
    so the resent scripts meet NOSCRIPT again (bench/chaos.py found it: the worker took that for
    a refusal, dead-lettered a claim and dropped a running job). Here every reload of the first
    few is flushed at once, more than one call's reloads (SCRIPT_RELOADS), so the worker meets
    NOSCRIPT and tries again later; every job ends whole, once."""
    load, flushes = execution.load_scripts, iter(range(execution.SCRIPT_RELOADS + 1))

    def load_then_lose(client, more=()):
        load(client, more)
        worker_threads = (worker.thread, worker.publication.publisher.thread)  # its loop, its publisher
        if threading.current_thread() in worker_threads and next(flushes, None) is not None:
            admin.script_flush()

    prompts = [alphabet(150, offset=i) for i in range(3)]
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        serving(restartable_redis.url, queue, step_s=0.01) as worker,
    ):
        running = [running_job(client, p) for p in prompts[:2]]
        monkeypatch.setattr(execution, "load_scripts", load_then_lose)  # the worker's reloads only
        admin.script_flush()
        queued = client.submit(prompts[2], max_tokens=150)  # its claim meets the flushes too
        for job_id, prompt in zip([*running, queued], prompts):
            assert_whole_output_once(admin, client, job_id, prompt)
        assert next(flushes, None) is None  # every flush happened
        assert worker.thread.is_alive() and admin.xlen(KEYS.dead(queue)) == 0


def test_deadlines_are_kept_on_redis_clock_whatever_the_workers_clock_says(restartable_redis, admin, queue):
    ahead = RedisClock(local=lambda: time.time() + 3600)  # this worker's clock is an hour fast
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        serving(restartable_redis.url, queue, step_s=0.01, clock=ahead),
    ):
        on_time = client.submit("x" * 20, max_tokens=20, timeout_s=30)
        # 3 s: time for a loaded machine to start it (at 1 s it expired queued once, under load),
        # and still well short of its 500 steps' 5 s.
        overdue = client.submit("y" * 500, max_tokens=500, timeout_s=3.0)
        finished = client.result(on_time, timeout=10)
        stopped = client.result(overdue, timeout=10)
    assert (finished.status, finished.finish_reason, finished.text) == ("done", "length", "x" * 20)
    assert (stopped.status, stopped.finish_reason) == ("done", "timeout")
    assert 0 < stopped.usage.completion_tokens < 500
    # Its end came at its deadline on Redis's clock (entry time + 3 s), give or take a step.
    assert stopped.timings.finished_at - stopped.timings.queued_at == pytest.approx(3.0, abs=0.3)


def test_a_reply_the_protocol_does_not_define_fails_its_job_and_keeps_its_tokens(
    restartable_redis,
    admin,
    queue,
    monkeypatch,
):
    parse = job_commands.parse_publish
    oks = iter(range(10**6))

    def garble_the_tenth_ok(reply):  # as if PUBLISH answered something v1 never does
        if reply in ("ok", "followed") and next(oks) == 9:  # followed: ok, and the reader is seen
            reply = "maybe"
        return parse(reply)

    monkeypatch.setattr(job_commands, "parse_publish", garble_the_tenth_ok)
    with (
        make_client("sync", restartable_redis.url, queue) as client,
        serving(restartable_redis.url, queue, step_s=0.01) as worker,
    ):
        job_id = running_job(client, alphabet(200))
        with pytest.raises(Exception) as failed:
            client.result(job_id, timeout=10)
        assert client.generate("next", max_tokens=4, timeout=10).text == "next"
        assert worker.thread.is_alive()
    result = failed.value.result
    assert (failed.value.code, result.status) == ("internal_error", "failed")
    assert "'maybe'" in failed.value.message
    assert result.text == alphabet(len(result.token_ids)) and len(result.token_ids) >= 10
    assert tokens_published(admin, job_id) == result.token_ids  # every token kept, once
