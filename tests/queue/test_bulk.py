"""Client.submit_many / as_completed / results / finished (and AsyncClient's twins, through the
`client` fixture) against a real redis-server: several chunks and windows of jobs at once, the
queue's bound crossed inside a chunk, request ids seen before, and results in finishing order."""

import threading
import time
import uuid

import pytest
import redis

from producer_client import (
    BulkQueueFull,
    Client,
    InvalidArgument,
    InvalidJob,
    JobNotFound,
    JobTimeout,
    RateLimited,
    ResultWatch,
    WaitingQuotaExceeded,
    bulk,
)
from producer_client.bulk import CHUNK, WINDOW
from producer_client.keys import Keys
from producer_client.placement import Placement
from tests.support.clients import make_client
from tests.support.workers import echo_workers

KEYS = Keys()


def entry_ids(redis_client, queue: str) -> list[str]:
    """The job ids of the queue stream's entries, in order."""
    return [fields["id"] for _, fields in redis_client.xrange(KEYS.queue(queue))]


def entries_added(redis_client, queue: str) -> int:
    """Every XADD the queue stream ever took: an entry added twice counts twice."""
    return redis_client.xinfo_stream(KEYS.queue(queue))["entries-added"]


def job_keys(redis_client) -> set[str]:
    """Every job hash in Redis (the server is shared by the session's tests)."""
    return {key for key in redis_client.scan_iter(KEYS.job("*"), count=10_000) if not key.endswith(":done")}


def specs(n: int, **extra) -> list[dict]:
    return [{"prompt": f"line {i}", "max_tokens": 4, "temperature": 0.0, **extra} for i in range(n)]


def test_submit_many_enqueues_every_job_once_in_order_over_several_chunks(client, redis_client, queue):
    n = 3 * CHUNK + 17
    ids = client.submit_many(specs(n))
    assert len(set(ids)) == n
    assert entry_ids(redis_client, queue) == ids
    assert entries_added(redis_client, queue) == n
    assert {client.status(job_id).status for job_id in ids[:: CHUNK // 2]} == {"queued"}


def test_a_job_with_a_timeout_gets_its_deadline(client, redis_client, queue):
    (job_id,) = client.submit_many([{"prompt": "hi", "timeout_s": 30.0}])
    deadline_ms = int(redis_client.hget(KEYS.job(job_id), "deadline"))
    assert abs(deadline_ms / 1000 - 30 - time.time()) < 5


def test_fresh_jobs_of_a_chunk_are_queued_with_their_own_deadlines(client, redis_client, queue):
    mixed = specs(CHUNK + 3) + [{"prompt": "later", "timeout_s": 60.0}] + specs(1, request_id=uuid.uuid4().hex)
    mixed[5] = {**mixed[5], "timeout_s": 30.0}
    ids = client.submit_many(mixed)
    assert entry_ids(redis_client, queue) == ids
    hashes = [redis_client.hgetall(KEYS.job(job_id)) for job_id in ids]
    assert {h["status"] for h in hashes} == {"queued"}
    with_deadline = {i: int(h["deadline"]) / 1000 - time.time() for i, h in enumerate(hashes) if "deadline" in h}
    assert sorted(with_deadline) == [5, CHUNK + 3]
    assert abs(with_deadline[5] - 30) < 5 and abs(with_deadline[CHUNK + 3] - 60) < 5


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"prompt": "x", "max_tokens": 0}, "jobs[2].max_tokens"),
        ({"prompt": "x", "max_tokenz": 8}, "jobs[2].max_tokenz"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "jobs[2].prompt"),
        ({"prompt": "x", "request_id": "has space"}, "jobs[2].request_id"),
        ({"prompt": "x" * (1 << 20)}, "jobs[2].body"),
        ("just a prompt", "jobs[2]"),
    ],
)
def test_an_invalid_spec_is_named_by_index_and_field_and_nothing_is_enqueued(client, redis_client, queue, bad, field):
    jobs = specs(CHUNK + 5)
    jobs[2] = bad
    before = job_keys(redis_client)
    with pytest.raises(InvalidArgument) as refused:
        client.submit_many(jobs)
    assert refused.value.field == field
    assert not redis_client.exists(KEYS.queue(queue))
    assert job_keys(redis_client) == before


@pytest.mark.parametrize("same_value_other_type", [1.0, True])
def test_sampling_parameters_equal_to_an_earlier_specs_but_of_another_type_are_refused(
    client, redis_client, queue, same_value_other_type
):
    jobs = specs(3, max_tokens=1) + specs(1, max_tokens=same_value_other_type)
    with pytest.raises(InvalidArgument) as refused:
        client.submit_many(jobs)
    assert refused.value.field == "jobs[3].max_tokens"
    assert not redis_client.exists(KEYS.queue(queue))


def test_request_ids_seen_before_enqueue_nothing_again(client, redis_client, queue):
    tag = uuid.uuid4().hex[:8]
    first = [{**spec, "request_id": f"{tag}-{i}"} for i, spec in enumerate(specs(CHUNK + 50))]
    ids = client.submit_many(first)
    assert ids == [f"{tag}-{i}" for i in range(CHUNK + 50)]
    more = [{**spec, "request_id": f"{tag}-{i}"} for i, spec in enumerate(specs(2 * CHUNK))]
    again = client.submit_many(more + first[:3])  # a request id twice in one call is one job
    assert again == [f"{tag}-{i}" for i in range(2 * CHUNK)] + ids[:3]
    assert entry_ids(redis_client, queue) == again[: 2 * CHUNK]
    assert entries_added(redis_client, queue) == 2 * CHUNK
    assert all(redis_client.hget(KEYS.job(job_id), "enqueued") == "1" for job_id in again[:: CHUNK // 4])


@pytest.mark.parametrize("depth_before", [0, CHUNK + 10])
def test_a_chunk_that_would_cross_the_bound_fills_the_queue_up_to_it(
    client_kind, redis_server, redis_client, queue, depth_before
):
    bound = depth_before + CHUNK + 37  # crossed inside the second chunk of this call
    bounded = make_client(client_kind, redis_server.url, queue, max_queue_depth=bound)
    unbounded = make_client(client_kind, redis_server.url, queue, max_queue_depth=None)
    try:
        unbounded.submit_many(specs(depth_before))
        tag = uuid.uuid4().hex[:8]
        jobs = [{**spec, "request_id": f"{tag}-{i}"} for i, spec in enumerate(specs(3 * CHUNK))]
        with pytest.raises(BulkQueueFull) as full:
            bounded.submit_many(jobs)
        assert full.value.job_ids == [f"{tag}-{i}" for i in range(CHUNK + 37)]
        assert (full.value.depth, full.value.max_depth) == (bound, bound)
        assert redis_client.xlen(KEYS.queue(queue)) == bound
        # The jobs that did not fit left no hash: the same call later enqueues them, and only them.
        assert not any(redis_client.exists(KEYS.job(f"{tag}-{i}")) for i in range(CHUNK + 37, 3 * CHUNK))
        assert bounded.submit_many(jobs[len(full.value.job_ids) - 5 :][:5]) == full.value.job_ids[-5:]
        assert unbounded.submit_many(jobs) == [f"{tag}-{i}" for i in range(3 * CHUNK)]
        assert entries_added(redis_client, queue) == depth_before + 3 * CHUNK
        assert entry_ids(redis_client, queue)[depth_before:] == [f"{tag}-{i}" for i in range(3 * CHUNK)]
    finally:
        bounded.close()
        unbounded.close()


def test_a_full_queue_refuses_the_first_chunk_whole(client_kind, redis_server, redis_client, queue):
    bounded = make_client(client_kind, redis_server.url, queue, max_queue_depth=3)
    before = job_keys(redis_client)
    try:
        bounded.submit_many(specs(3))
        with pytest.raises(BulkQueueFull) as full:
            bounded.submit_many(specs(10))
        assert full.value.job_ids == [] and full.value.depth == 3
        assert redis_client.xlen(KEYS.queue(queue)) == 3
        assert job_keys(redis_client) - before == {KEYS.job(job_id) for job_id in entry_ids(redis_client, queue)}
    finally:
        bounded.close()


def refused_flags(keys, enqueued, refused):
    """The round trip of the flags and the refused jobs' DEL, refused by Redis (as an ACL that
    grants no DEL would)."""
    return lambda pipe: pipe.execute_command("DEL")


def cut_flags(keys, enqueued, refused):
    """The round trip of the flags and the refused jobs' DEL, failed (the connection lost past the
    retries)."""

    def add(pipe):
        raise redis.ConnectionError("injected: the clean-up's connection is lost")

    return add


# Each refusal of a chunk's third job, the first two in: (the refusal, the client's settings, the
# tenant's limits, the stream the jobs go to).
PARTLY_REFUSED = {
    "full": (BulkQueueFull, {"max_queue_depth": 2}, None, lambda queue, tenant: KEYS.queue(queue)),
    "quota": (WaitingQuotaExceeded, {}, {"max_waiting": 2}, lambda q, t: KEYS.lane_stream(q, "default", t)),
    "rate": (RateLimited, {}, {"rpm": 2}, lambda q, t: KEYS.lane_stream(q, "default", t)),
}


@pytest.mark.parametrize("failing_flags", [refused_flags, cut_flags], ids=["refused", "cut"])
@pytest.mark.parametrize("refusal", list(PARTLY_REFUSED))
def test_submit_many_raises_its_refusal_when_the_clean_up_after_it_fails_and_logs_the_clean_up(
    client_kind, redis_server, redis_client, queue, monkeypatch, caplog, failing_flags, refusal
):
    """As a single submit's refusal (steps.undoing): the user must learn which jobs went in and
    why the others did not, whatever became of the round trip that flags the first and removes the
    others' hashes. A refused job whose hash stayed behind goes in when it is submitted again."""
    error, settings, limits, stream_of = PARTLY_REFUSED[refusal]
    tenant = f"t{uuid.uuid4().hex[:8]}" if limits else None
    if limits:
        with Client(redis_server.url, queue) as admin:
            admin.tenant_quotas.set(tenant, **limits)
    client = make_client(client_kind, redis_server.url, queue, tenant=tenant, **settings)
    try:
        tag = uuid.uuid4().hex[:8]
        jobs = [{"prompt": f"p{i}", "max_tokens": 2, "request_id": f"{tag}-{i}"} for i in range(4)]
        with monkeypatch.context() as injected:
            injected.setattr(bulk, "flag_commands", failing_flags)
            with pytest.raises(error) as refused:
                client.submit_many(jobs)
        in_queue = [f"{tag}-0", f"{tag}-1"]
        assert refused.value.job_ids == in_queue
        assert [fields["id"] for _, fields in redis_client.xrange(stream_of(queue, tenant))] == in_queue
        (logged,) = [record.getMessage() for record in caplog.records if record.name == "producer_client.steps"]
        assert logged.startswith(f"the clean-up after {error.__name__} failed too: ")
        if limits:
            with Client(redis_server.url, queue) as admin:
                admin.tenant_quotas.set(tenant, unset=tuple(limits))
        unbounded = make_client(client_kind, redis_server.url, queue, tenant=tenant, max_queue_depth=None)
        try:
            assert unbounded.submit_many(jobs) == [job["request_id"] for job in jobs]
        finally:
            unbounded.close()
        # The first two were left unflagged: they go in once more, which CLAIM drops (CREATE).
        entries = [fields["id"] for _, fields in redis_client.xrange(stream_of(queue, tenant))]
        assert entries == in_queue + [job["request_id"] for job in jobs]
    finally:
        client.close()


def cancel_in_order(client, job_ids: list[str], spaced: int | None = None) -> None:
    """Cancels the jobs one by one, the first `spaced` of them (all by default) 3 ms apart: their
    `done` entries a millisecond apart or more, so that their order is exact."""
    spaced = len(job_ids) if spaced is None else spaced
    for i, job_id in enumerate(job_ids):
        client.cancel(job_id)
        if i < spaced:
            time.sleep(0.003)


@pytest.fixture
def canceller(redis_server, queue):
    """A sync client of its own, to cancel jobs from another thread while the test reads."""
    other = Client(redis_server.url, queue)
    yield other
    other.close()


def test_as_completed_yields_in_the_order_jobs_end_over_several_windows(client, canceller, queue):
    ids = client.submit_many(specs(3 * WINDOW + 9))
    order = ids[:WINDOW][::-1] + ids[WINDOW:][::-1]
    cancel_in_order(client, order[:40])  # ended before the first read: it returns them in order
    # The order is asserted among the first window's jobs alone: those after it end as fast as they
    # are cancelled (1,033 jobs 3 ms apart were 3 s of each run's 7).
    thread = threading.Thread(target=cancel_in_order, args=(canceller, order[40:], WINDOW - 40))
    thread.start()
    try:
        ended = [result.id for result in client.as_completed(ids, timeout=120)]
    finally:
        thread.join()
    assert sorted(ended) == sorted(ids)  # each once
    assert ended[:40] == order[:40]
    # A read looks at the first WINDOW unfinished jobs: one beyond them that ends sooner comes
    # once it is among them, so the order is exact among the jobs of the first window.
    first_window = set(ids[:WINDOW])
    assert [j for j in ended[40:] if j in first_window] == [j for j in order[40:] if j in first_window]


def test_as_completed_refuses_an_unknown_job_before_yielding(client, queue):
    ids = client.submit_many(specs(CHUNK + 3))
    client.cancel(ids[0])
    with pytest.raises(JobNotFound) as missing:
        next(iter(client.as_completed([*ids, "no-such-job"], timeout=5)))
    assert missing.value.job_id == "no-such-job"
    with pytest.raises(InvalidArgument):
        next(iter(client.as_completed(["bad id"])))


def test_one_id_given_where_many_are_taken_is_refused_and_cancels_nothing(client, queue):
    """A string is an iterable of its characters: cancel_many(job_id) passed over 32 jobs that do
    not exist and cancelled nothing, silently."""
    job_id = client.submit(prompt="x", max_tokens=2)  # no worker serves this queue
    for call in (
        lambda: client.cancel_many(job_id),
        lambda: next(iter(client.as_completed(job_id))),
        lambda: client.results(job_id),
        lambda: ResultWatch(KEYS, job_id),
        lambda: ResultWatch(KEYS).add(job_id),
    ):
        with pytest.raises(InvalidArgument) as refused:
            call()
        assert refused.value.message == "job_ids: must be a list of job ids, not one id: wrap it, [job_id]"
    assert client.status(job_id).status == "queued"


def test_what_is_no_list_where_many_are_taken_is_refused_and_enqueues_or_cancels_nothing(client, redis_client, queue):
    """None (or a number) where a list of ids or specs is taken raised a TypeError from the loop over
    it, and a dict given to submit_many as one spec was refused as its first key's: each is one
    InvalidArgument naming the argument, before anything reaches Redis."""
    for call in (
        lambda: client.cancel_many(None),
        lambda: next(iter(client.as_completed(None))),
        lambda: client.results(7),
        lambda: ResultWatch(KEYS, None),
    ):
        with pytest.raises(InvalidArgument) as refused:
            call()
        assert refused.value.message == "job_ids: must be a list of job ids"
    for specs in (None, 3, {"prompt": "x"}, "x"):
        with pytest.raises(InvalidArgument) as refused:
            client.submit_many(specs)
        assert (
            refused.value.message
            == "jobs: must be a list of dicts of submit()'s keyword arguments (one alone: wrap it)"
        )
    assert redis_client.keys(f"*{queue}*") == []  # nothing enqueued, on any stream of the queue


@pytest.mark.parametrize("planted", ["job", "done"])
def test_a_job_key_of_another_type_is_that_jobs_invalid_job_to_the_bulk_calls_and_the_others_go_on(
    client, redis_client, queue, planted
):
    """cancel_many(), results() and as_completed() raised the raw WRONGTYPE of one job whose hash or
    done stream holds another type (someone's SET) for all the jobs asked about (a Redis failure the
    gateway answers 503): that job alone is its InvalidJob, a failed result with invalid_job, and
    cancel_many raises it once it has cancelled the others."""
    ids = client.submit_many(specs(4))  # no worker serves this queue
    bad = ids[1]
    key = {"job": KEYS.job, "done": KEYS.done}[planted](bad)
    redis_client.delete(key)
    redis_client.set(key, "not what the protocol writes here")
    with pytest.raises(InvalidJob) as invalid:
        client.cancel_many(ids)
    assert (invalid.value.code, invalid.value.job_id) == ("invalid_job", bad)
    assert [client.status(job_id).status for job_id in ids if job_id != bad] == ["cancelled"] * 3
    expected = [(job_id, "cancelled", None) for job_id in ids]
    expected[1] = (bad, "failed", "invalid_job")
    results = client.results(ids, timeout=5)
    assert [(r.id, r.status, r.error and r.error.code) for r in results] == expected
    assert sorted((r.id, r.status) for r in client.as_completed(ids, timeout=5)) == sorted(e[:2] for e in expected)
    assert redis_client.get(key) == "not what the protocol writes here"  # nothing written over it


@pytest.mark.timing
def test_as_completed_times_out_naming_an_unfinished_job(client, queue):
    ids = client.submit_many(specs(5))
    client.cancel(ids[0])
    seen = []
    started = time.monotonic()
    with pytest.raises(JobTimeout) as late:
        for result in client.as_completed(ids, timeout=0.3):
            seen.append(result.id)
    waited = time.monotonic() - started
    assert seen == [ids[0]]
    assert late.value.job_id == ids[1] and late.value.timeout == 0.3
    assert 0.3 <= waited < 2.0


def test_results_come_in_the_order_asked(client, queue):
    ids = client.submit_many(specs(7))
    cancel_in_order(client, ids[::-1])
    assert [r.id for r in client.results(ids[::2] + ids[1::2], timeout=5)] == ids[::2] + ids[1::2]


def test_finished_takes_what_has_ended_as_jobs_are_added(client, queue):
    ids = client.submit_many(specs(6))
    watch = ResultWatch(KEYS, ids[:3])
    assert client.finished(watch, timeout=0.2) == []
    cancel_in_order(client, [ids[4], ids[1]])
    assert [r.id for r in client.finished(watch, timeout=5)] == [ids[1]]
    watch.add(ids[3:])
    assert [r.id for r in client.finished(watch, timeout=5)] == [ids[4]]
    assert len(watch) == 4


# -- with workers ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def echo_queue():
    return f"bulk-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def bulk_workers(redis_server, echo_queue, tmp_path_factory):
    with echo_workers(redis_server.url, echo_queue, tmp_path_factory.mktemp("bulk-workers")) as workers:
        yield workers


def test_many_jobs_through_two_workers_each_once(client_kind, redis_server, redis_client, echo_queue, bulk_workers):
    client = make_client(client_kind, redis_server.url, echo_queue)
    try:
        jobs = [{"prompt": f"job {i:05d}", "max_tokens": 64, "temperature": 0.0} for i in range(3 * CHUNK)]
        ids = client.submit_many(jobs)
        results = {r.id: r for r in client.as_completed(ids, timeout=120)}
    finally:
        client.close()
    assert sorted(results) == sorted(ids)
    assert all(results[job_id].text == job["prompt"] for job_id, job in zip(ids, jobs))
    assert {r.worker for r in results.values()} == {w.name for w in bulk_workers}


def test_a_failed_job_is_yielded_and_a_short_job_ends_before_a_long_one(
    client_kind, redis_server, echo_queue, bulk_workers
):
    client = make_client(client_kind, redis_server.url, echo_queue)
    try:
        long, bad, short = client.submit_many(
            [
                {"prompt": "x" * 3000, "max_tokens": 3000, "temperature": 0.0},
                {"input_ids": [999], "max_tokens": 4},  # no such byte: the echo engine refuses it
                {"prompt": "short", "max_tokens": 8, "temperature": 0.0},
            ]
        )
        ended = list(client.as_completed([long, bad, short], timeout=120))
    finally:
        client.close()
    assert ended[-1].id == long and ended[-1].text == "x" * 3000
    by_id = {r.id: r for r in ended}
    assert by_id[bad].status == "failed" and by_id[bad].error.code == "invalid_argument"
    assert by_id[short].text == "short"


def commands_of(step) -> list[tuple]:
    """The commands a step adds, as the exchange records them (redis-py's command names: a
    method's or execute_command's alike), each its arguments."""
    from producer_client.protocol.execution import recorder

    pipe = recorder()
    step(pipe)
    return [args for args, _ in pipe.stack]


def test_on_one_server_the_fresh_jobs_of_a_chunk_are_created_by_one_script_call():
    from producer_client import bulk
    from producer_client.protocol.producer import CREATE_MANY, ENQUEUE_MANY

    jobs = bulk.build_jobs(specs(2) + specs(1, timeout_s=2.5) + specs(1, request_id="r0"))
    steps = bulk.submit_steps(KEYS, "q", None, jobs, Placement(False), one_server=True)
    assert [c[0] for c in commands_of(steps.send(None))] == ["EVALSHA"]  # CREATE of the request id
    enqueue = commands_of(steps.send([1]))
    assert [c[1] for c in enqueue] == [CREATE_MANY.sha, ENQUEUE_MANY.sha]
    fresh = jobs[:3]
    assert enqueue[0][2:] == (3, *(KEYS.job(job.job_id) for job in fresh), 0, 0, 2500)


def test_an_enqueue_that_fails_takes_back_the_hashes_of_its_jobs():
    from producer_client import bulk

    jobs = bulk.build_jobs([{**spec, "request_id": f"r{i}"} for i, spec in enumerate(specs(3))] + specs(1))
    steps = bulk.submit_steps(KEYS, "q", None, jobs, Placement(False))
    creates = commands_of(steps.send(None))
    assert [c[0] for c in creates] == ["EVALSHA"] * 3  # CREATE of the request ids first
    enqueue = commands_of(steps.send([1, 0, 1]))  # r1 is in the queue already
    assert [c[0] for c in enqueue] == ["HSETNX", "EVALSHA"]
    assert enqueue[-1][6:] == ("r0", jobs[0].body, "r2", jobs[2].body, jobs[3].job_id, jobs[3].body)
    forget = commands_of(steps.throw(ConnectionError("lost")))
    assert forget == [("DEL", KEYS.job("r0"), KEYS.job("r2"), KEYS.job(jobs[3].job_id))]
    with pytest.raises(ConnectionError):
        steps.send([1])
