"""The producer client against a real redis-server with no worker: validation, idempotency,
backpressure, status, cancel of a queued job, a submit stopped mid-enqueue. Every test runs with
Client and AsyncClient (a stopped submit is stopped each one's way: Ctrl-C, a task's cancel)."""

import asyncio
import json
import signal
import threading
import time
import uuid

import pytest
import redis
from redis.exceptions import NoScriptError

from harness.polling import eventually
from producer_client import (
    AsyncClient,
    Client,
    InvalidArgument,
    InvalidJob,
    JobExpired,
    JobFailed,
    JobNotFound,
    JobTimeout,
    QueueFull,
    aio,
    job_stream,
    new_job,
    status_reads,
    waiting,
)
from producer_client.bulk import ResultWatch
from producer_client.keys import DONE_TTL_MS, GROUP, Keys
from producer_client.new_job import build_job_of
from producer_client.protocol import execution
from producer_client.protocol import worker as worker_scripts
from producer_client.protocol.script import add_all
from producer_client.schema import JobResult
from producer_client.steps import run as run_steps
from tests.support.clients import commands_sent, make_client
from worker.embedded_redis import EmbeddedRedis, free_port
from worker.loop.worker_queue import WorkerQueue

pytestmark = pytest.mark.waits

DEAD_URL = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: any command would raise ConnectionError


BAD_SUBMITS = [
    (dict(prompt="hi", max_tokens=0), "max_tokens"),
    (dict(prompt="hi", max_tokens=40000), "max_tokens"),
    (dict(prompt="hi", max_tokens="8"), "max_tokens"),
    (dict(prompt="hi", temperature=-0.5), "temperature"),
    (dict(prompt="hi", top_p=1.5), "top_p"),
    (dict(prompt="hi", stop=["x"] * 17), "stop"),
    (dict(prompt="hi", stop=["y" * 257]), "stop"),
    (dict(prompt="hi", logprobs=50), "logprobs"),
    (dict(prompt="hi", min_tokens=9, max_tokens=8), "min_tokens"),
    (dict(prompt="hi", speculative="no"), "speculative"),  # the opt-out of speculative decoding is a bool
    (dict(prompt="hi", colour="red"), "colour"),
    (dict(), "prompt"),
    (dict(prompt=""), "prompt"),
    (dict(prompt="hi", input_ids=[1, 2]), "prompt"),
    (dict(messages=[{"role": "robot", "content": "x"}]), "messages.0.role"),
    (dict(messages=[{"role": "user"}]), "messages.0.content"),
    (dict(input_ids=[1, -2]), "input_ids"),
    (dict(prompt="hi", request_id="has space"), "request_id"),
    (dict(prompt="hi", request_id="{tag}"), "request_id"),
    (dict(prompt="hi", timeout_s=0), "timeout_s"),
    (dict(prompt="hi", priority=10**6), "priority"),
    (dict(prompt="hi", service_tier=["flex"]), "service_tier"),  # a TypeError (unhashable) where a tier is looked up
    (dict(prompt="x" * (1 << 20)), "body"),
    # A chat's options, given at any value: enable_thinking=True on a prompt passed, False did not.
    (dict(prompt="hi", enable_thinking=True), "enable_thinking"),
    (dict(prompt="hi", enable_thinking=False), "enable_thinking"),
    (dict(input_ids=[1, 2], parallel_tool_calls=True), "parallel_tool_calls"),
    (dict(input_ids=[1, 2], tool_choice="none"), "tool_choice"),
]


@pytest.mark.parametrize("kwargs, field", BAD_SUBMITS)
def test_invalid_arguments_raise_before_anything_reaches_redis(client_kind, kwargs, field):
    c = make_client(client_kind, DEAD_URL, "default")
    try:
        with pytest.raises(InvalidArgument) as e:
            c.submit(**kwargs)
        assert e.value.field == field
    finally:
        c.close()


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda c: c.result("bad id"), "job_id"),
        (lambda c: c.result("ok", timeout=-1), "timeout"),
        (lambda c: list(c.stream("ok", after="latest")), "after"),
        (lambda c: c.status("a{b}"), "job_id"),
        (lambda c: c.cancel(""), "job_id"),
        (lambda c: c.generate("hi", timeout=0), "timeout"),
        # AttributeErrors (no `window`), and None taken for a watch of no jobs: the watch was used unchecked
        (lambda c: c.finished(["a"]), "watch"),
        (lambda c: c.finished(None), "watch"),
    ],
)
def test_invalid_reads_raise_before_anything_reaches_redis(client_kind, call, field):
    c = make_client(client_kind, DEAD_URL, "default")
    try:
        with pytest.raises(InvalidArgument) as e:
            call(c)
        assert e.value.field == field
    finally:
        c.close()


def test_a_wait_for_what_is_no_job_id_is_an_invalid_argument_after_a_submit_too(client, redis_client, queue):
    """The client's memory of its submits was looked up with the id before the id was checked: once
    it held a job, wait(["a"]) raised a TypeError (unhashable) instead of InvalidArgument."""
    job_id = client.submit(prompt="x", max_tokens=2)  # no worker serves this queue
    for bad in (["a"], {"id": "a"}, None):
        with pytest.raises(InvalidArgument) as e:
            client.wait(bad, timeout=1)
        assert e.value.field == "job_id"
    assert client.status(job_id).status == "queued"


@pytest.mark.parametrize("unset", ["rpm", "", None, 5])
def test_the_quota_settings_to_unset_are_a_list_of_names_or_an_invalid_argument(client_kind, unset):
    """One name given where many are taken was its characters ('r' is not a quota setting; "" unset
    nothing, silently), and None or a number raised a TypeError from the loop over it."""
    c = make_client(client_kind, DEAD_URL, "default")
    try:
        with pytest.raises(InvalidArgument) as e:
            c.tenant_quotas.set("team-a", unset=unset)
        assert (e.value.field, e.value.message) == (
            "unset",
            "unset: must be a list of quota settings' names (max_waiting, rpm, tpm, weight), not one: wrap it, [name]",
        )
    finally:
        c.close()


def test_invalid_client_settings_raise(client_kind):
    with pytest.raises(InvalidArgument) as e:
        make_client(client_kind, DEAD_URL, "bad queue")
    assert e.value.field == "queue"
    with pytest.raises(InvalidArgument) as e:
        make_client(client_kind, DEAD_URL, "q", max_queue_depth=0)
    assert e.value.field == "max_queue_depth"


@pytest.mark.parametrize("max_connections", [0, -1, True, 1.5, "8"])
def test_a_bad_max_connections_is_an_invalid_argument_naming_it(client_kind, max_connections):
    """redis-py raised its own ValueError for -1 and took 0 (and True) as no bound at all; a URL's
    max_connections option was refused as InvalidArgument already."""
    with pytest.raises(InvalidArgument) as e:
        make_client(client_kind, DEAD_URL, "q", max_connections=max_connections)
    assert e.value.field == "max_connections"


@pytest.mark.parametrize("placement", ["no", "false", None, 0])
def test_a_placement_that_is_not_a_bool_is_an_invalid_argument_naming_it(client_kind, placement):
    """ "no" and "false" are true: they turned placement on, where the caller meant it off."""
    with pytest.raises(InvalidArgument) as e:
        make_client(client_kind, DEAD_URL, "q", placement=placement)
    assert e.value.field == "placement"


def test_same_request_id_twice_gives_one_job_and_one_stream_entry(client, redis_client, queue):
    request_id = f"order-{queue}"
    first = client.submit("hello", max_tokens=4, request_id=request_id)
    second = client.submit("hello", max_tokens=4, request_id=request_id)  # another request: test_idempotency.py
    assert first == second == request_id
    entries = redis_client.xrange(Keys().queue(queue))
    assert len(entries) == 1
    assert entries[0][1]["id"] == request_id
    assert '"hello"' in entries[0][1]["body"]


def test_a_submit_that_stopped_half_way_is_completed_by_the_next_one(client, redis_client, queue):
    # The first submit created the job and was cut off before its entry was added (or before
    # the reply came back): the job would wait forever. A second submit with the same id adds it.
    request_id = f"half-{queue}"
    redis_client.hset(Keys().job(request_id), "status", "queued")
    assert client.submit("hello", max_tokens=4, request_id=request_id) == request_id
    assert [f["id"] for _, f in redis_client.xrange(Keys().queue(queue))] == [request_id]
    assert client.submit("hello", max_tokens=4, request_id=request_id) == request_id  # now recorded
    assert redis_client.xlen(Keys().queue(queue)) == 1


def flush_after_loads(monkeypatch, redis_client, times: int) -> list:
    """The scripts lost again right after each of the next `times` loads, as when two SCRIPT
    FLUSHes (or two failovers) land either side of the load that follows a NOSCRIPT. Returns the
    flushes still to come."""
    left = [None] * times

    def lose_again() -> None:
        if left:
            left.pop()
            redis_client.script_flush()

    load, aload = execution.load_scripts, execution.aload_scripts

    def load_then_lose(client, more=()):
        load(client, more)
        lose_again()

    async def aload_then_lose(client, more=()):
        await aload(client, more)
        lose_again()

    monkeypatch.setattr(execution, "load_scripts", load_then_lose)
    monkeypatch.setattr(execution, "aload_scripts", aload_then_lose)
    return left


def test_a_submit_whose_scripts_are_lost_again_after_each_reload_enqueues_once(
    client_kind,
    queue,
    monkeypatch,
):
    # A server of its own, as below: on the session's, another process's client (a gateway or a
    # worker another module started) loaded the scripts between the flush and the submit once, and
    # the submit met no NOSCRIPT at all.
    with EmbeddedRedis(port=free_port()) as server, redis.Redis.from_url(server.url, decode_responses=True) as admin:
        client = make_client(client_kind, server.url, queue)
        try:
            left = flush_after_loads(monkeypatch, admin, execution.SCRIPT_RELOADS - 1)
            admin.script_flush()
            job_id = client.submit("hello", max_tokens=4)  # CREATE and ENQUEUE meet NOSCRIPT three times
            assert left == []
            assert [f["id"] for _, f in admin.xrange(Keys().queue(queue))] == [job_id]
            assert client.status(job_id).status == "queued"
        finally:
            client.close()


def test_a_server_that_loses_the_scripts_at_every_reload_fails_the_submit_and_enqueues_nothing(
    client_kind,
    queue,
    monkeypatch,
):
    # A server of its own: on the session's, any other process's client (a worker a test left
    # serving, or one of another module) may load the scripts between a flush and the resend.
    with EmbeddedRedis(port=free_port()) as server, redis.Redis.from_url(server.url) as admin:
        client = make_client(client_kind, server.url, queue)
        try:
            flush_after_loads(monkeypatch, admin, execution.SCRIPT_RELOADS)
            admin.script_flush()
            with pytest.raises(NoScriptError):
                client.submit("hello", max_tokens=4)
        finally:
            client.close()
        assert admin.xlen(Keys().queue(queue)) == 0


def test_submit_raises_queue_full_at_the_configured_depth(client_kind, redis_server, redis_client, queue):
    c = make_client(client_kind, redis_server.url, queue, max_queue_depth=3)
    try:
        for _ in range(3):
            c.submit("x", max_tokens=1)
        with pytest.raises(QueueFull) as e:
            c.submit("x", max_tokens=1)
        assert (e.value.depth, e.value.max_depth, e.value.code) == (3, 3, "queue_full")
        with pytest.raises(QueueFull):
            c.submit("x", max_tokens=1, request_id=f"never-{queue}")
        assert not redis_client.exists(Keys().job(f"never-{queue}"))
    finally:
        c.close()
    assert redis_client.xlen(Keys().queue(queue)) == 3


def test_a_queued_job_reports_queued_and_its_result_times_out(client):
    job_id = client.submit("x", max_tokens=1)
    status = client.status(job_id)
    assert (status.status, status.tokens, status.worker, status.result) == ("queued", 0, None, None)
    with pytest.raises(JobTimeout):
        client.result(job_id, timeout=0.05)
    with pytest.raises(JobTimeout):
        list(client.stream(job_id, timeout=0.05))


@pytest.mark.parametrize("request_id", [None, "deadline-rid"])
def test_a_queued_job_past_its_deadline_reads_as_expired_before_any_worker_sees_it(client, request_id):
    if request_id is not None:
        request_id = f"{request_id}-{uuid.uuid4().hex[:6]}"
    job_id = client.submit("x", max_tokens=1, timeout_s=0.3, request_id=request_id)
    assert client.status(job_id).status == "queued"
    time.sleep(0.4)
    assert client.status(job_id).status == "expired"


def test_a_clients_memo_of_validated_sampling_parameters_lets_no_bad_value_through(client_kind):
    """A client validates each set of sampling parameters once (new_job.sampling_params): a value
    equal to a remembered one but of another type is validated again (True and 1.0 are no
    max_tokens, though both equal 1), and the memo starts again past KNOWN_PARAMS sets. The
    submits' timeout_s is refused after their sampling parameters are validated: nothing is sent."""
    c = make_client(client_kind, DEAD_URL, "default")
    try:
        refused = []
        for max_tokens in (1, True, 1.0, 1):
            with pytest.raises(InvalidArgument) as e:
                c.submit("hi", timeout_s=-1, max_tokens=max_tokens)
            refused.append(e.value.field)
        assert refused == ["timeout_s", "max_tokens", "max_tokens", "timeout_s"]
        assert list(c.known_params) == [(("max_tokens", int, 1),)]
        for i in range(new_job.KNOWN_PARAMS + 3):
            with pytest.raises(InvalidArgument):
                c.submit("hi", timeout_s=-1, max_tokens=1, temperature=i / 1000)
        assert len(c.known_params) == 4
    finally:
        c.close()


EXPIRES_S = 0.3  # the job's timeout_s: no worker serves the queue, so it expires unread
WAIT_S = 30  # the caller's timeout, which an expired job must not wait out


def wait_for_it(client, how: str, submitter):
    """`how` the client waits for a job that expires unread; "wait elsewhere": wait() of a job that
    `submitter`, another client, submitted (its deadline is read from the job, not remembered)."""
    if how == "generate":
        return client.generate("x", max_tokens=1, timeout_s=EXPIRES_S, timeout=WAIT_S)
    job_id = (submitter if how == "wait elsewhere" else client).submit("x", max_tokens=1, timeout_s=EXPIRES_S)
    if how == "stream":
        return list(client.stream(job_id, timeout=WAIT_S))
    return getattr(client, how.split()[0])(job_id, timeout=WAIT_S)


@pytest.fixture
def other_client(client_kind, redis_server, queue):
    """Another client of the test's queue: it shares no memory with `client`."""
    c = make_client(client_kind, redis_server.url, queue)
    yield c
    c.close()


@pytest.mark.timing
@pytest.mark.parametrize("how", ["result", "wait", "wait elsewhere", "generate", "stream"])
def test_waiting_for_a_job_that_expires_unread_raises_job_expired_at_its_deadline(client, other_client, how):
    started = time.monotonic()
    with pytest.raises(JobExpired) as e:
        wait_for_it(client, how, other_client)
    waited = time.monotonic() - started
    assert EXPIRES_S <= waited < EXPIRES_S + 2  # its deadline, not the caller's 30 s
    assert (e.value.code, e.value.result) == ("expired", None)
    assert e.value.message == f"job {e.value.job_id} passed its deadline before a worker started it"
    assert client.status(e.value.job_id).status == "expired"


@pytest.mark.parametrize("how", ["result", "wait", "generate", "stream"])
def test_a_caller_whose_timeout_is_the_jobs_own_gets_job_expired(redis_server, how):
    """The gateway waits exactly as long as its jobs' timeout_s: the caller's end and the job's
    come within milliseconds, in either order on the caller's clock, and the job's end is the
    answer (a CI run once answered JobTimeout: a look within the deadline's millisecond, see
    test_a_deadline_has_passed_a_microsecond_after_it_...). Eight jobs at once, each waited on for
    its own timeout_s, on a queue no worker reads."""

    async def wait_as_long_as_the_job(client: AsyncClient):
        if how == "generate":
            return await client.generate("x", max_tokens=1, timeout_s=EXPIRES_S, timeout=EXPIRES_S)
        job_id = await client.submit("x", max_tokens=1, timeout_s=EXPIRES_S)
        if how == "stream":
            return [delta async for delta in client.stream(job_id, timeout=EXPIRES_S)]
        return await getattr(client, how)(job_id, timeout=EXPIRES_S)

    async def main():
        async with AsyncClient(redis_server.url, f"unread-{uuid.uuid4().hex[:8]}") as client:
            return await asyncio.gather(*(wait_as_long_as_the_job(client) for _ in range(8)), return_exceptions=True)

    outcomes = asyncio.run(main())
    assert [type(o).__name__ for o in outcomes] == ["JobExpired"] * 8


@pytest.mark.parametrize("timeout_s", [None, 60])
def test_a_wait_after_this_clients_submit_blocks_from_its_first_round_trip(
    client, other_client, monkeypatch, timeout_s
):
    """wait() of a job this client submitted knows its deadline (or that it has none): its first
    round trip is the blocking read of the job's `done` stream, and it never looks at the job's
    hash (within KEPT_S of the submit its done stream holds its end if it has ended). A job another
    client submitted is looked at first (HMGET of its status, deadline and result), then read;
    so is this client's job at a second wait(), once the first took its entry. (The callers'
    timeouts are short: the reads time out, no worker serves the queue.)"""
    mine = client.submit("x", max_tokens=1, timeout_s=timeout_s)
    theirs = other_client.submit("x", max_tokens=1, timeout_s=timeout_s)
    sent = commands_sent(monkeypatch)
    rounds = []
    for job_id in (mine, theirs, mine):
        with pytest.raises(JobTimeout):
            client.wait(job_id, timeout=0.05)
        rounds.append(sent[:])
        sent.clear()
    assert [r[0] for r in rounds] == [["XREAD"], ["HMGET", "TIME"], ["HMGET", "TIME"]]
    assert [r[1] for r in rounds[1:]] == [["XREAD"]] * 2
    if timeout_s is None:  # else the caller's timeout ends with a look, for JobExpired (unless_expired)
        assert {c for trip in rounds[0] for c in trip} == {"XREAD"}


@pytest.mark.parametrize("stalled", [False, True])
def test_a_wait_reads_the_jobs_hash_only_where_its_done_stream_may_have_lost_its_end(client, monkeypatch, stalled):
    """A wait of many blocking reads (each block cut to 20 ms here) reads only the job's done
    stream while each read begins within KEPT_S of the last moment the job was seen unended (its
    submit, then each read that found no end): a job that ended since is in the stream. Where that
    moment is older (a process stalled between two reads for longer than KEPT_S: KEPT_S 0 here),
    each read is followed by the job's result in its hash (HGET), which holds it for ever after."""
    monkeypatch.setattr(waiting, "MAX_BLOCK_MS", 20)
    if stalled:
        monkeypatch.setattr(waiting.Submissions, "KEPT_S", 0.0)
    job_id = client.submit("x", max_tokens=1)
    sent = commands_sent(monkeypatch)
    with pytest.raises(JobTimeout):
        client.wait(job_id, timeout=0.3)
    reads = [trip for trip in sent if trip[0] == "XREAD"]
    assert len(reads) >= 2  # Redis ends a block at its own pace (its timers' resolution), 20 ms or more
    assert set(map(tuple, reads)) == {("XREAD", "HGET") if stalled else ("XREAD",)}


def test_a_wait_long_after_the_submit_finds_a_result_whose_done_stream_is_gone_at_once(
    client, redis_client, monkeypatch
):
    """A job this client submitted, which ended longer ago than its `done` stream lives: wait()
    looks at the job first, as for a job submitted elsewhere, and answers from its hash at once
    (a first blocking read would wait out its whole block, 2 s, for nothing)."""
    job_id = client.submit("x", max_tokens=1)
    result = JobResult(id=job_id, status="done", text="x", finish_reason="length")
    redis_client.hset(Keys().job(job_id), mapping={"status": "done", "result": result.model_dump_json()})
    monkeypatch.setattr(waiting.Submissions, "KEPT_S", 0.0)  # submitted too long ago: its done stream may be gone
    started = time.monotonic()
    assert client.wait(job_id, timeout=WAIT_S).text == "x"
    assert time.monotonic() - started < 1


def test_the_copies_a_gateway_serves_its_requests_with_share_the_clients_memory_of_its_jobs():
    """The gateway submits and waits on a copy per request (on_queue, as_tenant): a copy's wait
    after another copy's submit is one round trip too."""
    c = Client(DEAD_URL, "default")
    try:
        assert c.on_queue("other").as_tenant("acme").submissions is c.submissions
    finally:
        c.close()


@pytest.mark.parametrize("reader", ["done", "events"])
def test_a_job_past_its_deadline_at_the_callers_timeout_is_job_expired_whatever_the_local_clock_says(
    client, redis_client, reader
):
    """The ordering the test above can only sometimes meet: the caller's timeout comes first on
    its own clock (a process descheduled between a reply and its clock read puts the job's end
    later there), while Redis's clock has passed the job's deadline."""
    job_id = client.submit("x", max_tokens=1, timeout_s=0.05)
    time.sleep(0.1)
    later_here = time.monotonic() + 60
    if reader == "done":
        steps = waiting.wait_done(client.keys, job_id, waiting.Deadline(job_id, 0.01), expires_at=later_here)
    else:
        stream = job_stream.JobStream(job_id, "0-0")
        stream.expires_at = later_here
        steps = stream.read(client.keys, waiting.Deadline(job_id, 0.01))
    time.sleep(0.02)
    with pytest.raises(JobExpired):
        run_steps(redis_client, steps)


DEADLINE_MS = 1_700_000_000_300  # a job's deadline as CREATE writes it: epoch ms on Redis's clock


@pytest.mark.parametrize("past_us", [1, 500, 999])
def test_a_deadline_has_passed_a_microsecond_after_it_for_the_caller_and_the_status_as_for_the_worker(past_us):
    """The cause of test_a_caller_whose_timeout_is_the_jobs_own_gets_job_expired[stream]'s flake:
    the job's deadline is a whole millisecond, and the client compared it with TIME's whole
    milliseconds, so a look within the deadline's millisecond found the job unexpired. A stream's
    caller whose timeout is the job's own reaches its end there (its timer is its own, where a
    blocking read ends when Redis's does), and was answered JobTimeout for a job expired by a
    worker's rule (now > deadline, to the microsecond). Both rules are the worker's now; at the
    deadline itself the job is queued still."""
    seconds, ms = divmod(DEADLINE_MS, 1000)
    after = (seconds, ms * 1000 + past_us)
    with pytest.raises(JobExpired):
        waiting.expiry("j", "queued", str(DEADLINE_MS), after)
    queued = {"status": "queued", "deadline": str(DEADLINE_MS)}
    assert status_reads.job_status("j", queued, after).status == "expired"
    at_it = (seconds, ms * 1000)
    assert waiting.expiry("j", "queued", str(DEADLINE_MS), at_it) is not None
    assert status_reads.job_status("j", queued, at_it).status == "queued"


@pytest.mark.timing
@pytest.mark.parametrize("how", ["result", "wait", "wait elsewhere", "stream"])
def test_waiting_for_a_job_expired_already_raises_job_expired_at_once(client, other_client, how):
    job_id = (other_client if how == "wait elsewhere" else client).submit("x", max_tokens=1, timeout_s=0.05)
    time.sleep(0.1)
    started = time.monotonic()
    with pytest.raises(JobExpired) as e:
        if how == "stream":
            list(client.stream(job_id, timeout=WAIT_S))
        else:
            getattr(client, how.split()[0])(job_id, timeout=WAIT_S)
    assert time.monotonic() - started < 1
    assert e.value.job_id == job_id


@pytest.mark.timing
def test_as_completed_yields_a_job_that_expires_unread_at_its_deadline(client):
    late = client.submit("x", max_tokens=1, timeout_s=0.05)
    time.sleep(0.1)
    started = time.monotonic()
    soon = client.submit("x", max_tokens=1, timeout_s=EXPIRES_S)
    cancelled = client.submit("x", max_tokens=1)
    client.cancel(cancelled)
    ended = [(r.id, r.status) for r in client.as_completed([soon, late, cancelled], timeout=WAIT_S)]
    waited = time.monotonic() - started
    assert set(ended[:2]) == {(cancelled, "cancelled"), (late, "expired")}  # both ended at the call
    assert ended[2:] == [(soon, "expired")]
    assert EXPIRES_S <= waited < EXPIRES_S + 2  # the last one's deadline, not the caller's 30 s
    (result,) = client.results([soon], timeout=WAIT_S)
    assert (result.status, result.finish_reason, result.text) == ("expired", None, "")


def test_unknown_jobs_are_not_found(client):
    for call in (client.status, client.result, client.cancel, lambda j: list(client.stream(j))):
        with pytest.raises(JobNotFound):
            call("no-such-job")


def test_cancelling_a_queued_job_ends_it_at_once(client):
    job_id = client.submit("x", max_tokens=1)
    status = client.cancel(job_id)
    assert status.status == "cancelled" and status.cancel_requested
    result = client.result(job_id, timeout=1)
    assert (result.status, result.finish_reason, result.text, result.token_ids) == ("cancelled", "abort", "", [])
    assert list(client.stream(job_id, timeout=1)) == []
    assert client.cancel(job_id).status == "cancelled"  # a second cancel changes nothing


def end_as_a_worker(redis_client, job_id: str, text: str, keys: Keys | None = None) -> JobResult:
    """The job claimed and ended in one final PUBLISH, as a worker whose job ends within its first
    checkpoint interval does: one run, nobody streaming it. Returns the result written."""
    keys = keys or Keys()
    result = JobResult(id=job_id, status="done", text=text, token_ids=list(text.encode()), finish_reason="stop")
    tokens = json.dumps({"ids": result.token_ids, "text": text})
    calls = [
        worker_scripts.claim(keys, job_id, "w1", "1-0", 60, "r1"),
        worker_scripts.publish(keys, job_id, "r1", "{}", tokens, 0, len(text), "done", result.model_dump_json(), 60),
    ]
    assert execution.execute(redis_client, add_all(calls), worker_scripts.WORKER_SCRIPTS) == [["claimed", 0], "written"]
    return result


def test_a_job_ended_before_its_reader_came_is_read_from_its_hash(client, redis_client, monkeypatch):
    # Protocol v2: a finished job keeps its hash; its done stream goes DONE_TTL_MS after the end (as
    # its deletion here), and its events went at the end (one run, nobody streaming it). So the
    # submits are as old as that to the client too (KEPT_S 0): its memory of them stands for none.
    monkeypatch.setattr(waiting.Submissions, "KEPT_S", 0.0)
    ended = {
        job_id: end_as_a_worker(redis_client, job_id, f"out{i}")
        for i, job_id in enumerate(client.submit(f"p{i}", max_tokens=4) for i in range(3))
    }
    cancelled = client.submit("c", max_tokens=4)
    client.cancel(cancelled)
    ids = [*ended, cancelled]
    redis_client.delete(*(Keys().done(job_id) for job_id in ids))
    assert not redis_client.exists(*(Keys().events(job_id) for job_id in ids))
    for job_id, result in ended.items():
        assert client.result(job_id, timeout=1) == result
        assert client.wait(job_id, timeout=1) == result
        (delta,) = list(client.stream(job_id, timeout=1))
        assert (delta.event_id, delta.token_ids, delta.text) == (job_stream.WHOLE_OUTPUT, result.token_ids, result.text)
        assert list(client.stream(job_id, after=delta.event_id, timeout=1)) == []
        assert client.status(job_id).status == "done"
    assert [r.id for r in client.results(ids, timeout=1)] == ids
    assert {r.id: r.status for r in client.as_completed(ids, timeout=1)} == {
        **dict.fromkeys(ended, "done"),
        cancelled: "cancelled",
    }
    assert list(client.stream(cancelled, timeout=1)) == []


def test_a_wait_that_misses_the_done_stream_reads_the_result_from_the_hash_after_its_block(redis_client):
    # A waiter whose first look preceded the job's end, and whose blocking read began after the done
    # stream went (a reader stalled for longer than DONE_TTL_MS between the two): its read blocks
    # once, for nothing, and the look at the hash that follows it in the same round trip finds it
    # before the caller's time is up.
    job_id = uuid.uuid4().hex
    result = end_as_a_worker(redis_client, job_id, "out")
    redis_client.delete(Keys().done(job_id))
    found = run_steps(redis_client, waiting.wait_done(Keys(), job_id, waiting.Deadline(job_id, 0.5), None))
    assert JobResult.model_validate_json(found) == result


def test_a_client_knows_the_expiry_of_its_own_submits_once_and_for_half_the_done_streams_life():
    """What lets wait() skip its look at a job this client just submitted: within DONE_TTL_MS / 2
    of the submit the job's done stream holds its end if it has ended (its first blocking read
    returns at once), and the expiry the submit knew stands in for the job's deadline."""
    now = [100.0]
    kept = waiting.Submissions(clock=lambda: now[0])
    assert waiting.Submissions.KEPT_S == DONE_TTL_MS / 2000
    kept.add("a", 130.0)
    kept.add("b", None)
    assert (kept.known("a"), kept.known("a")) == ((130.0, 100.0), waiting.NOTHING_KNOWN)  # once: a later wait looks
    assert waiting.NOTHING_KNOWN == (waiting.UNKNOWN, None)
    assert kept.known("someone else's") == waiting.NOTHING_KNOWN
    now[0] += waiting.Submissions.KEPT_S
    assert kept.known("b") == waiting.NOTHING_KNOWN  # too old: its end may be older than its done stream
    kept.add("c", None)
    now[0] += waiting.Submissions.KEPT_S / 2
    kept.add("d", 1.0)
    assert (kept.known("d"), kept.known("c")) == ((1.0, now[0]), (None, now[0] - waiting.Submissions.KEPT_S / 2))
    for i in range(3):  # what is kept: the submits of the last two generations at most
        now[0] += waiting.Submissions.KEPT_S
        kept.add(f"e{i}", None)
    assert set(kept.current) | set(kept.previous) == {"e1", "e2"}


def test_a_clients_watch_follows_its_jobs_under_its_prefix_as_they_are_added(
    client_kind, redis_server, redis_client, queue
):
    """docs/batch.md: a sliding window's jobs are collected with a ResultWatch and finished(); a user
    had to build one as ResultWatch(Keys(prefix)), the client's internal key names, and a watch of
    another prefix than the client's waited for ever. client.watch() makes it over the client's."""
    keys = Keys("mili2")
    client = make_client(client_kind, redis_server.url, queue, prefix=keys.prefix)
    try:
        first = client.submit("p0", max_tokens=4)
        watch = client.watch([first])
        later = client.submit("p1", max_tokens=4)
        watch.add([later])
        results = [end_as_a_worker(redis_client, job_id, f"out{i}", keys) for i, job_id in enumerate([first, later])]
        found: list[JobResult] = []
        while len(found) < 2:
            found += client.finished(watch, timeout=10)
        assert sorted(found, key=lambda r: r.id) == sorted(results, key=lambda r: r.id)
    finally:
        client.close()


def test_a_watch_left_unread_past_the_done_streams_life_finds_its_jobs_in_their_hashes(client, redis_client):
    ids = [client.submit(f"p{i}", max_tokens=4) for i in range(4)]
    watch = ResultWatch(Keys(), ids)
    assert client.finished(watch, timeout=0.2) == []  # read once: none has ended
    results = [end_as_a_worker(redis_client, job_id, f"out{i}") for i, job_id in enumerate(ids)]
    redis_client.delete(*(Keys().done(job_id) for job_id in ids))  # gone before the watch reads again
    # the caller came back after longer than the streams live
    watch.looked = {job_id: at - DONE_TTL_MS / 1000 for job_id, at in watch.looked.items()}
    assert client.finished(watch, timeout=1) == results
    assert len(watch) == 0


def test_a_watch_whose_reads_missed_a_done_stream_finds_the_job_in_its_hash_within_half_its_life(client, redis_client):
    # The reads go on, each well within DONE_TTL_MS of the last, but none saw the job's done entry
    # (a reply lost with its connection, the read retried after the stream went): the job's next
    # look at its hash, half the streams' life after its last, finds it. (It waited for ever.)
    ids = [client.submit(f"p{i}", max_tokens=4) for i in range(3)]
    watch = ResultWatch(Keys(), ids)
    assert client.finished(watch, timeout=0.2) == []  # looked at: none has ended
    looked = time.monotonic()
    result = end_as_a_worker(redis_client, ids[1], "out1")
    redis_client.delete(Keys().done(ids[1]))
    found: list[JobResult] = []
    while not found and time.monotonic() - looked < 2 * DONE_TTL_MS / 1000:
        found = client.finished(watch, timeout=0.3)
    assert found == [result]
    assert time.monotonic() - looked < DONE_TTL_MS / 2000 + 1.5
    assert [job_id for job_id in watch.waiting] == [ids[0], ids[2]]


def test_jobs_whose_done_streams_expired_on_their_own_are_read_whole_by_every_reader(client, redis_client):
    """The tests above delete the done streams; here Redis expires them, DONE_TTL_MS after each
    job's end, while a watch that read before the ends waits: every reader finds each result after."""
    ids = [client.submit(f"p{i}", max_tokens=4) for i in range(4)]
    watch = ResultWatch(Keys(), ids)
    assert client.finished(watch, timeout=0.2) == []  # read once: none has ended
    results = [end_as_a_worker(redis_client, job_id, f"out{i}") for i, job_id in enumerate(ids)]
    done_keys = [Keys().done(job_id) for job_id in ids]
    assert redis_client.exists(*done_keys) == len(ids)
    started = time.monotonic()
    assert eventually(lambda: redis_client.exists(*done_keys) == 0, timeout=3 * DONE_TTL_MS / 1000, interval=0.1)
    assert time.monotonic() - started >= DONE_TTL_MS / 1000 - 0.5  # gone by their TTL, not before
    assert client.finished(watch, timeout=1) == results
    assert client.results(ids, timeout=1) == results
    for job_id, result in zip(ids, results):
        assert client.result(job_id, timeout=1) == client.wait(job_id, timeout=1) == result
        assert "".join(delta.text for delta in client.stream(job_id, timeout=1)) == result.text


def test_queue_stats_count_waiting_and_pending_entries(client, redis_client, queue):
    empty = dict(queue=queue, depth=0, pending=0, waiting=0, workers=[], streams=[])
    assert client.queue_stats().model_dump() == empty
    for _ in range(3):
        client.submit("x", max_tokens=1)
    stream = Keys().queue(queue)
    redis_client.xgroup_create(stream, GROUP, id="0")
    redis_client.xreadgroup(GROUP, "w1", {stream: ">"}, count=1)
    stats = client.queue_stats()
    assert (stats.queue, stats.depth, stats.pending, stats.waiting, stats.workers) == (queue, 3, 1, 2, [])
    assert [s.model_dump() for s in stats.streams] == [
        dict(lane="default", tenant=None, worker=None, shard=0, depth=3, pending=1, waiting=2)
    ]


@pytest.mark.slow
def test_a_wait_longer_than_the_socket_timeout_reads_in_bounded_blocks(client):
    # redis-py drops a connection silent for 5 s (its default socket_timeout): a wait of 6 s
    # must be several blocking reads, and end in JobTimeout, not in a socket error.
    job_id = client.submit("x", max_tokens=1)
    with pytest.raises(JobTimeout):
        client.result(job_id, timeout=6)


def test_workers_lists_the_live_workers_of_every_queue_from_their_heartbeats(client, redis_server, redis_client, queue):
    other = f"{queue}-other"
    heartbeat = {
        "device": "cpu",
        "state": "serving",
        "running": 2,
        "free_slots": 3,
        "free_pages": 40,
        "started_at": 1.5,
        "pid": 7,
    }
    for name, worker_queue, model in (
        (f"{queue}-a", queue, "tiny"),
        (f"{queue}-b", other, "/models/qwen"),
        (f"{queue}-dead", queue, "tiny"),
        (f"{queue}-odd", queue, "tiny"),
    ):
        fields = {**heartbeat, "name": name, "queue": worker_queue, "model": model}
        WorkerQueue(redis_client, Keys(), worker_queue, name).members.heartbeat(fields, ttl_s=5, held=[])
    redis_client.delete(Keys().worker(f"{queue}-dead"))  # as when its TTL runs out
    # A heartbeat no worker of this version writes (another version's, during an upgrade) is left
    # out: the others are listed, and a gateway's model table, read from them, still serves.
    redis_client.hset(Keys().worker(f"{queue}-odd"), mapping={"state": "warming", "running": "many"})
    redis_client.pexpire(Keys().worker(f"{queue}-odd"), 5000)

    mine = sorted((w for w in client.workers() if w.queue in (queue, other)), key=lambda w: w.name)
    assert [(w.name, w.queue, w.model, w.state, w.running, w.free_slots, w.free_pages) for w in mine] == [
        (f"{queue}-a", queue, "tiny", "serving", 2, 3, 40),
        (f"{queue}-b", other, "/models/qwen", "serving", 2, 3, 40),
    ]
    with Client(redis_server.url, queue) as operator:  # `mili workers`' view
        health = {w.name: w for w in operator.inspect.workers() if w.queue in (queue, other)}
    assert (health[f"{queue}-odd"].condition, health[f"{queue}-odd"].info) == ("unreadable", None)
    assert health[f"{queue}-a"].condition == "live"


def test_a_client_on_another_queue_shares_the_connection_pool(client, redis_client, queue):
    other = client.on_queue(f"{queue}-2")
    job_id = other.submit("hi", max_tokens=1)
    assert (client.queue, other.queue, other.redis) == (queue, f"{queue}-2", client.redis)
    assert [f["id"] for _, f in redis_client.xrange(Keys().queue(f"{queue}-2"))] == [job_id]
    assert redis_client.xlen(Keys().queue(queue)) == 0
    with pytest.raises(InvalidArgument, match="queue"):
        client.on_queue("{bad}")


def test_cancel_many_cancels_each_job_and_passes_over_an_unknown_one(client):
    job_ids = [client.submit("x", max_tokens=1) for _ in range(3)]
    client.cancel_many([job_ids[0], "no-such-job", *job_ids[1:]])
    assert [client.status(job_id).status for job_id in job_ids] == ["cancelled"] * 3
    assert [client.wait(job_id, timeout=1).finish_reason for job_id in job_ids] == ["abort"] * 3


# A WAIT no replica answers holds a submit's enqueue this long on the server, unless it is stopped.
HELD_ENQUEUE_MS = 20_000
# The held client's socket timeout outlasts that WAIT: at redis-py's default (5 s) its own read gave
# up first, so a test slowed past 5 s by load met RedisTimedOut before it could stop the enqueue.
HELD_SOCKET_TIMEOUT_S = 2 * HELD_ENQUEUE_MS // 1000


def held_enqueue_client(make, redis_server, queue):
    url = f"{redis_server.url}?socket_timeout={HELD_SOCKET_TIMEOUT_S}"
    return make(url, queue, wait_replicas=1, wait_timeout_ms=HELD_ENQUEUE_MS)


def enqueue_reached_redis(redis_client, request_id: str) -> bool:
    """The pipeline that enqueues the job has run up to its WAIT: the `enqueued` flag is set."""
    return eventually(lambda: redis_client.hget(Keys().job(request_id), "enqueued") == "1")


def test_a_submit_interrupted_in_its_enqueue_leaves_no_job_behind(redis_server, redis_client, queue):
    # Ctrl-C while the enqueue's reply is awaited: the job hash goes, so that the same request_id
    # submitted again enqueues the job rather than finding one that may never run.
    request_id = f"interrupted-{queue}"
    main = threading.get_ident()

    def interrupt_once_enqueued() -> None:
        if enqueue_reached_redis(redis_client, request_id):
            signal.pthread_kill(main, signal.SIGINT)

    interrupter = threading.Thread(target=interrupt_once_enqueued)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    started = time.monotonic()
    try:
        with held_enqueue_client(Client, redis_server, queue) as client:
            interrupter.start()
            with pytest.raises(KeyboardInterrupt):
                client.submit("hi", max_tokens=1, request_id=request_id)
    finally:
        interrupter.join()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - started < HELD_ENQUEUE_MS / 1000 / 2  # stopped, not timed out
    assert redis_client.exists(Keys().job(request_id)) == 0
    with Client(redis_server.url, queue) as again:
        assert again.submit("hi", max_tokens=1, request_id=request_id) == request_id
        assert again.status(request_id).status == "queued"


async def test_a_submit_cancelled_in_its_enqueue_leaves_no_job_behind(redis_server, redis_client, queue):
    # The asyncio twin: the task is cancelled while the enqueue's reply is awaited.
    request_id = f"cancelled-{queue}"
    started = time.monotonic()
    async with held_enqueue_client(AsyncClient, redis_server, queue) as client:
        task = asyncio.ensure_future(client.submit("hi", max_tokens=1, request_id=request_id))
        assert await asyncio.to_thread(enqueue_reached_redis, redis_client, request_id)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert time.monotonic() - started < HELD_ENQUEUE_MS / 1000 / 2
    assert redis_client.exists(Keys().job(request_id)) == 0
    async with AsyncClient(redis_server.url, queue) as again:
        assert await again.submit("hi", max_tokens=1, request_id=request_id) == request_id
        assert (await again.status(request_id)).status == "queued"


@pytest.mark.parametrize(
    "fields",
    [
        {"status": "bogus"},
        {"tokens": "3"},
        {"status": "running", "tokens": "many"},
        {"status": "queued", "deadline": "soon"},
        {"status": "done", "result": "not json"},
    ],
)
def test_a_job_hash_no_worker_wrote_is_an_invalid_job_to_status(client, redis_client, fields):
    """A producer may write a job's hash: what no worker writes there is the job's `invalid_job`
    (the code a worker fails such a job with), never a parse error of the client's."""
    job_id = f"planted-{uuid.uuid4().hex[:8]}"
    redis_client.hset(Keys().job(job_id), mapping=fields)
    with pytest.raises(InvalidJob) as invalid:
        client.status(job_id)
    assert (invalid.value.code, invalid.value.job_id) == ("invalid_job", job_id)


def test_a_result_no_worker_wrote_fails_its_job_alone_with_invalid_job(client, redis_client):
    """result() raises JobFailed, as_completed() yields the failed result and the others'."""
    bad, good = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("bad", "good"))
    redis_client.hset(Keys().job(bad), mapping={"status": "done", "result": "not json"})
    ok = JobResult(id=good, status="done", text="ok").model_dump_json()
    redis_client.hset(Keys().job(good), mapping={"status": "done", "result": ok})
    with pytest.raises(JobFailed) as failed:
        client.result(bad, timeout=5)
    assert failed.value.code == "invalid_job"
    results = {r.id: r for r in client.as_completed([bad, good], timeout=5)}
    assert (results[good].status, results[good].text) == ("done", "ok")
    assert (results[bad].status, results[bad].error.code) == ("failed", "invalid_job")


# What reads each of a job's keys: a string planted there (someone's SET) is met by these.
READS_OF_KEY = {
    "job": ["status", "result", "wait", "stream", "cancel"],
    "done": ["result", "wait"],
    "events": ["stream"],
}


@pytest.mark.parametrize("planted", list(READS_OF_KEY))
def test_a_job_key_of_another_type_is_that_jobs_invalid_job_and_the_next_job_is_read(
    client, redis_client, queue, planted
):
    """A string where a job's hash, `done` stream or event stream lies (WRONGTYPE) is that job's
    InvalidJob to every read that meets it, at once: an error of the job alone, not a Redis failure
    that a caller (the gateway: 503 redis_unavailable) would retry; the next job is read as ever."""
    bad, good = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("bad", "good"))
    keys = Keys()
    for job_id in (bad, good):
        redis_client.hset(keys.job(job_id), "status", "queued")
    key = {"job": keys.job, "done": keys.done, "events": keys.events}[planted](bad)
    redis_client.delete(key)
    redis_client.set(key, "not what the protocol writes here")
    reads = {
        "status": lambda: client.status(bad),
        "result": lambda: client.result(bad, timeout=5),
        "wait": lambda: client.wait(bad, timeout=5),
        "stream": lambda: list(client.stream(bad, timeout=5)),
        "cancel": lambda: client.cancel(bad),
    }
    for read in READS_OF_KEY[planted]:
        started = time.monotonic()
        with pytest.raises(InvalidJob) as invalid:
            reads[read]()
        assert (invalid.value.code, invalid.value.job_id) == ("invalid_job", bad), read
        assert str(invalid.value) == (
            f"job {bad!r}: a key of it holds a value of another type than its own, which no worker writes: "
            "submit it anew under a fresh id"
        )
        assert time.monotonic() - started < 2, read  # at once, not at the caller's timeout
    assert client.status(good).status == "queued"
    assert redis_client.get(key) == "not what the protocol writes here"  # nothing was written over it


@pytest.mark.parametrize(
    "fields",
    [
        {"status": "done"},
        {"status": "failed"},
        {"status": "bogus"},
        {"tokens": "1"},
        {"status": "queued", "deadline": "x"},
    ],
    ids=["done-without-result", "failed-without-result", "unknown-status", "no-status", "deadline-no-number"],
)
def test_a_job_hash_no_worker_writes_is_that_jobs_invalid_job_to_a_wait_at_once(client, redis_client, fields):
    """A producer may write a job's hash: an ended status without the result every end writes with
    it kept result(), wait() and stream() blocking to the caller's timeout (for ever without one), a hash
    without a status or with a deadline that is no number raised KeyError or ValueError from
    result(). Each is the job's InvalidJob now, at once, as status() reads it."""
    job_id = f"junk-{uuid.uuid4().hex[:8]}"
    redis_client.hset(Keys().job(job_id), mapping=fields)
    waits = {
        "result": lambda: client.result(job_id, timeout=5),
        "stream": lambda: list(client.stream(job_id, timeout=5)),
    }
    if "status" in fields:  # wait() does not look the job up first: a hash with no status is no job yet to it
        waits["wait"] = lambda: client.wait(job_id, timeout=5)
    for name, call in waits.items():
        started = time.monotonic()
        with pytest.raises(InvalidJob) as invalid:
            call()
        assert (invalid.value.code, invalid.value.job_id) == ("invalid_job", job_id), name
        assert "holds a status or a deadline the protocol does not define" in str(invalid.value)
        assert time.monotonic() - started < 2, name  # at once, not at the caller's timeout


def heavy_format(tag: str) -> dict:
    """A schema the grammar library takes about half a second to compile (60,000 values), of values
    no other test sends: compile_error's cache cannot have it."""
    schema = {"enum": [f"{tag}{value}" for value in range(60_000)]}
    return {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}


async def longest_pause_of_the_loop_during(work) -> tuple[float, float]:
    """(the longest the event loop went without running a ticking coroutine, how long `work` took)."""
    ticks = [time.monotonic()]

    async def tick() -> None:
        while True:
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())

    ticker = asyncio.ensure_future(tick())
    await asyncio.sleep(0.05)  # ticking
    started = time.monotonic()
    await work
    ended = time.monotonic()
    ticker.cancel()
    during = [started, *(t for t in ticks if started < t < ended), ended]
    return max(b - a for a, b in zip(during, during[1:])), ended - started


@pytest.mark.timing  # a pause against the compile's time: the load of tests beside it moves both
@pytest.mark.parametrize("many", [False, True])
async def test_a_grammar_being_checked_holds_no_other_coroutine(redis_server, queue, many):
    """AsyncClient's submit (and submit_many) compiles a job's grammar to check it, up to seconds of
    CPU for a large schema, in which the library lets the GIL go: on the caller's event loop it held
    every other coroutine of the program. Jobs that carry a grammar are checked on a thread."""
    jobs = [{"prompt": "hi", "max_tokens": 2, "response_format": heavy_format(uuid.uuid4().hex[:6])} for _ in range(2)]
    async with AsyncClient(redis_server.url, queue) as client:

        async def submit_them() -> None:
            if many:
                await client.submit_many(jobs)
            else:
                for job in jobs:
                    await client.submit(**job)

        paused, took = await longest_pause_of_the_loop_during(submit_them())
        assert (await client.queue_stats()).waiting == 2
    # On the loop, the longest pause would be one job's compile, half of `took` (~0.2 s alone on this
    # VM, seconds beside a loaded lane): it must stand well above the ticks' 10 ms to be seen.
    assert took > 0.2, "the grammar compiled too fast to hold anything"
    assert paused < took / 3, (paused, took)


@pytest.mark.parametrize("long", ["messages", "input_ids"])
async def test_a_long_job_is_built_off_the_event_loop(redis_server, queue, monkeypatch, long):
    """A job of many messages (or token ids) takes up to 130 ms to validate and serialize (33,000
    messages), in pieces between which the interpreter hands the GIL to the loop's thread: built on
    the caller's event loop, it held every other coroutine that long (the gateway's 128 choices of
    one such prompt, 17 s). AsyncClient builds such a job on a thread, a short one in place."""
    built_on = []

    def recorded(*args, **kwargs):
        built_on.append(threading.current_thread() is threading.main_thread())
        return build_job_of(*args, **kwargs)

    monkeypatch.setattr(aio, "build_job_of", recorded)
    arguments = (
        {"messages": [{"role": "user", "content": "a"}] * 600} if long == "messages" else {"input_ids": [1] * 20_000}
    )
    async with AsyncClient(redis_server.url, queue) as client:
        await client.submit_rated(**arguments, max_tokens=1)
        await client.submit_rated(prompt="short", max_tokens=1)
        assert (await client.queue_stats()).waiting == 2
    assert built_on == [False, True]


def run_streamed_as_a_worker(
    redis_client, job_id: str, pieces: list[str], before: str = "", ends: bool = True
) -> list[str]:
    """The job claimed (unless it was, with `before` its output so far), each piece published as
    one `tokens` event, then (`ends`) ended, by a run that streams it (its events kept). Returns the
    job's `tokens` events' ids, in order."""
    keys, offset = Keys(), len(before)
    calls = [] if before else [worker_scripts.claim(keys, job_id, "w1", "1-0", 60, "r1")]
    for piece in pieces:
        tokens = json.dumps({"ids": list(piece.encode()), "text": piece})
        start = "" if offset else "{}"
        calls.append(
            worker_scripts.publish(keys, job_id, "r1", start, tokens, offset, offset + len(piece), "", "", 60, True)
        )
        offset += len(piece)
    if ends:
        text = before + "".join(pieces)
        result = JobResult(id=job_id, status="done", text=text, token_ids=list(text.encode()), finish_reason="stop")
        calls.append(
            worker_scripts.publish(
                keys, job_id, "r1", "", "", offset, offset, "done", result.model_dump_json(), 60, True
            )
        )
    execution.execute(redis_client, add_all(calls), worker_scripts.WORKER_SCRIPTS)
    return [i for i, fields in redis_client.xrange(keys.events(job_id)) if fields["type"] == "tokens"]


# Stream ids as Redis reads them after (XREAD): in each documented form, and not.
IDS_REDIS_TAKES = ["0", "0-0", "7", "007-01", str(2**64 - 1), f"{2**64 - 1}-{2**64 - 1}", "$"]
IDS_REDIS_REFUSES = [
    "",
    "latest",
    "-1",
    "1-",
    "-",
    "+",
    "*",
    "1-*",
    "1-2-3",
    "0x10",
    "1.5",
    "1 ",
    str(2**64),
    f"1-{2**64}",
]


@pytest.mark.parametrize("after", IDS_REDIS_TAKES + IDS_REDIS_REFUSES)
def test_stream_takes_as_after_the_stream_ids_redis_takes(client, redis_client, after):
    """`after` is a stream id: `stream(after="0")` was refused though Redis reads `0` (from the
    start), as it reads `ms` alone (`ms-0`) and `$`; an id past 2^64 - 1 reached Redis and came
    back as its untyped error. Each is taken or refused (InvalidArgument) as XREAD takes it."""
    try:
        redis_client.xread({f"ids-{uuid.uuid4().hex[:8]}": after}, count=1)
        redis_takes = True
    except redis.ResponseError:
        redis_takes = False
    job_id = client.submit("hi", max_tokens=4)
    run_streamed_as_a_worker(redis_client, job_id, ["ab"])
    try:
        list(client.stream(job_id, after=after, timeout=5))
        client_takes = True
    except InvalidArgument as e:
        assert e.field == "after"
        client_takes = False
    assert client_takes == redis_takes


def test_stream_after_an_id_in_any_form_reads_what_xread_reads_after_it(client, redis_client):
    """Each form of `after` means what it means to Redis: the tokens after it, as XREAD reads them.
    `$` is the last event when the stream opens: none of an ended job's."""
    job_id = client.submit("hi", max_tokens=8)
    ids = run_streamed_as_a_worker(redis_client, job_id, ["ab", "cd", "ef"])
    ms, seq = ids[1].split("-")
    events = Keys().events(job_id)
    for after in ["0", "0-0", ms, ids[1], f"00{ms}-0{seq}", "$"]:
        ((_, read),) = redis_client.xread({events: after}) or [(events, [])]
        expected = [i for i, fields in read if fields["type"] == "tokens"]
        assert [d.event_id for d in client.stream(job_id, after=after, timeout=5)] == expected, after


def test_stream_after_dollar_reads_the_events_that_come_after_it_opens(client, redis_client):
    """`$` as XREAD reads it: the job's last event when the stream opens. A running job's tokens
    published before are not read, those published after are, and its end."""
    job_id = client.submit("hi", max_tokens=8)
    run_streamed_as_a_worker(redis_client, job_id, ["ab"], ends=False)
    keys = Keys()
    reader, deadline = run_steps(redis_client, job_stream.follow(keys, job_id, "$", 10))
    ids = run_streamed_as_a_worker(redis_client, job_id, ["cd", "ef"], before="ab")
    deltas = []
    while reader.end is None:
        deltas += run_steps(redis_client, reader.read(keys, deadline))
    assert [(d.event_id, d.text) for d in deltas] == [(ids[1], "cd"), (ids[2], "ef")]
    assert [d.text for d in client.stream(job_id, after="$", timeout=5)] == []  # ended: nothing after its end
