"""A cancelled queued job stops counting at once: its entry leaves its stream, so the stream's
bound (`max_queue_depth`), the tenant's waiting quota (`max_waiting`) and `queue_stats` no longer
count it, on a queue no worker serves as on a busy one, whichever client cancels it; its keys get
the result TTL the queue's workers publish, as a worker's claim would give them; an entry a worker
read first (then killed: a reclaim) is left to the worker that claims it; and a cancel that races a
worker's reads ends the job once, as cancelled, with nothing left counted. Real redis-server, the
real clients, the queue loop on the echo engine."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from harness.echo_workers import HoldingEchoEngine, outcome_count, serving
from harness.polling import eventually
from producer_client import Client, QueueFull, WaitingQuotaExceeded
from producer_client.keys import CANCELLED_TTL_S, GROUP, LANES, Keys
from producer_client.protocol import producer as scripts
from producer_client.protocol.replies import removal_ttl
from producer_client.protocol.script import ScriptCall, job_keys
from tests.support.clients import make_client

pytestmark = pytest.mark.waits

KEYS = Keys()
N = 3
RESULT_TTL_S = 90


@pytest.fixture
def tenant():
    return f"t{uuid.uuid4().hex[:8]}"


def unread(redis_client, stream: str) -> int:
    """What ENQUEUE_LANES counts of a stream against the waiting quota: its entries no worker read."""
    length = redis_client.xlen(stream)
    groups = {g["name"]: g for g in redis_client.xinfo_groups(stream)} if length else {}
    return length - (groups[GROUP]["pending"] if GROUP in groups else 0)


def run_call(redis_client, call: ScriptCall):
    return redis_client.eval(call.script.source, len(call.keys), *call.keys, *call.args)


def set_max_waiting(url: str, queue: str, tenant: str, max_waiting: int) -> None:
    with Client(url, queue) as admin:
        admin.tenant_quotas.set(tenant, max_waiting=max_waiting)


def tenant_streams(queue: str, tenant: str) -> list[str]:
    return [KEYS.lane_stream(queue, lane, tenant) for lane in LANES]


def test_cancelled_queued_jobs_free_the_tenants_waiting_quota_at_once(redis_server, client_kind, queue, tenant):
    """No worker serves the queue: N jobs fill the quota, their cancels free it, N more go in."""
    client = make_client(client_kind, redis_server.url, queue, tenant=tenant)
    try:
        set_max_waiting(redis_server.url, queue, tenant, N)
        first = [client.submit("a", max_tokens=2, service_tier=tier) for tier in ("flex", "default", "priority")]
        with pytest.raises(WaitingQuotaExceeded):
            client.submit("over", max_tokens=2)
        assert client.queue_stats().waiting == N
        for job_id in first:
            assert client.cancel(job_id).status == "cancelled"
        stats = client.queue_stats()
        assert (stats.depth, stats.waiting) == (0, 0)
        second = [client.submit("b", max_tokens=2) for _ in range(N)]
        with pytest.raises(WaitingQuotaExceeded):
            client.submit("over", max_tokens=2)
        assert [client.status(job_id).status for job_id in first + second] == ["cancelled"] * N + ["queued"] * N
        assert client.queue_stats().waiting == N
    finally:
        client.close()


def test_cancelled_queued_jobs_free_the_streams_bound_at_once_whoever_cancels(redis_server, client_kind, queue):
    """The queue's own stream with its bound: one client submits, another (which never saw the
    entries) cancels, one by one and with cancel_many; the bound counts only live jobs."""
    producer = make_client(client_kind, redis_server.url, queue, max_queue_depth=N)
    other = make_client(client_kind, redis_server.url, queue)
    try:
        first = [producer.submit("a", max_tokens=2) for _ in range(N)]
        with pytest.raises(QueueFull):
            producer.submit("over", max_tokens=2)
        other.cancel(first[0])
        other.cancel_many(first[1:])
        assert producer.queue_stats().depth == 0
        second = [producer.submit("b", max_tokens=2) for _ in range(N)]
        with pytest.raises(QueueFull):
            producer.submit("over", max_tokens=2)
        assert [producer.status(job_id).status for job_id in second] == ["queued"] * N
    finally:
        producer.close()
        other.close()


def test_cancelled_queued_jobs_of_submit_many_free_the_bound_and_the_quota_at_once(
    redis_server, client_kind, queue, tenant
):
    """submit_many's jobs are recorded by the same enqueue scripts (ENQUEUE_MANY on the queue's own
    stream, ENQUEUE_LANES on a tenant's lanes): their cancels free their places too."""
    producer = make_client(client_kind, redis_server.url, queue, max_queue_depth=N)
    tenants = make_client(client_kind, redis_server.url, f"{queue}-t", tenant=tenant)
    try:
        set_max_waiting(redis_server.url, f"{queue}-t", tenant, N)
        for client, refusal in ((producer, QueueFull), (tenants, WaitingQuotaExceeded)):
            first = client.submit_many([{"prompt": "a", "max_tokens": 2}] * N)
            with pytest.raises(refusal):
                client.submit("over", max_tokens=2)
            client.cancel_many(first)
            stats = client.queue_stats()
            assert (stats.depth, stats.waiting) == (0, 0)
            second = client.submit_many([{"prompt": "b", "max_tokens": 2}] * N)
            with pytest.raises(refusal):
                client.submit("over", max_tokens=2)
            assert [client.status(job_id).status for job_id in first + second] == ["cancelled"] * N + ["queued"] * N
    finally:
        producer.close()
        tenants.close()


def test_an_entry_a_worker_has_read_is_left_to_it_and_another_jobs_is_never_removed(redis_client, queue):
    stream = KEYS.queue(queue)
    ids = [uuid.uuid4().hex for _ in range(2)]
    entries = [redis_client.xadd(stream, {"id": job_id, "v": "2", "body": "{}"}) for job_id in ids]
    redis_client.xgroup_create(stream, GROUP, "0")
    redis_client.xreadgroup(GROUP, "w", {stream: ">"}, count=1)  # the first is read: pending

    def remove(job_id: str, entry_id: str):
        entry = scripts.WaitingEntry.recorded(KEYS, f"{entry_id} {stream}")
        assert entry is not None
        return run_call(redis_client, scripts.remove_entry(job_id, entry))

    assert remove(ids[0], entries[0]) == 0  # read: left to its worker
    assert remove(ids[0], entries[1]) == 0  # a forged record: another job's entry
    assert redis_client.xlen(stream) == 2
    assert remove(ids[1], entries[1]) == 1
    assert remove(ids[1], entries[1]) == 0  # twice: once
    assert redis_client.xlen(stream) == 1 and unread(redis_client, stream) == 0


def test_the_ttl_a_removal_gives_is_the_workers_published_one_within_cancelled_ttl_s():
    assert removal_ttl(1, str(RESULT_TTL_S), CANCELLED_TTL_S) == RESULT_TTL_S
    assert removal_ttl(1, str(10 * CANCELLED_TTL_S), CANCELLED_TTL_S) == CANCELLED_TTL_S  # a producer's write
    for removed, published in ((0, "60"), (1, None), (1, "0"), (1, "-5"), (1, "junk")):
        assert removal_ttl(removed, published, CANCELLED_TTL_S) is None


def test_a_record_naming_no_queue_stream_of_the_prefix_is_not_followed():
    """The record is the producers' to write (docs/security.md): one that names another prefix's
    stream, a worker's own or no stream at all is no entry a cancel looks for."""
    lane = KEYS.lane_stream("q", "flex", "t")
    assert scripts.WaitingEntry.recorded(KEYS, f"1-1 {lane}") == (lane, "1-1", KEYS.published_ttl("q"))
    for forged in ("1-1 other:q:{q}", f"1-1 {KEYS.own_queue('q', 'w')}", "x-1 " + KEYS.queue("q"), "1-1", None, 7):
        assert scripts.WaitingEntry.recorded(KEYS, forged) is None


def test_a_cancel_gives_a_removed_jobs_keys_the_result_ttl_its_workers_publish(redis_server, redis_client, queue):
    """A worker of one slot holds a job that never ends by itself; the next waits in the stream
    (the worker reads only what it can start). Cancelled, it leaves the stream at once, and no
    worker will ever claim it, so its keys get the workers' result_ttl_s from the canceller, not
    CANCELLED_TTL_S: every job key still goes within result_ttl_s. On a queue no worker ever served
    nothing is published, and the keys keep CANCELLED_TTL_S."""
    with Client(redis_server.url, queue) as client:
        with serving(
            redis_server.url,
            queue,
            0.005,
            engine_class=HoldingEchoEngine,
            engine={"max_running": 1},
            result_ttl_s=RESULT_TTL_S,
        ) as worker:
            held = client.submit("x" * 200, max_tokens=200)  # held past its 100th token
            assert eventually(lambda: worker.holdings.running)
            waiting = client.submit("y", max_tokens=2)
            time.sleep(0.2)  # several of the worker's reads: it takes no job it cannot start
            assert client.status(waiting).status == "queued"
            assert client.cancel(waiting).status == "cancelled"
            assert client.queue_stats().depth == 1  # the held job's entry alone
            ttls = [redis_client.ttl(key) for key in job_keys(KEYS, waiting) if redis_client.exists(key)]
            assert ttls and all(0 < ttl <= RESULT_TTL_S for ttl in ttls)
            client.cancel(held)
            assert client.result(held, timeout=30).status == "cancelled"
        assert eventually(lambda: redis_client.xlen(KEYS.queue(queue)) == 0)
    with Client(redis_server.url, f"{queue}-parked") as parked:
        job_id = parked.submit("z", max_tokens=2)
        parked.cancel(job_id)
        assert parked.queue_stats().depth == 0
        assert redis_client.ttl(KEYS.job(job_id)) > RESULT_TTL_S  # CANCELLED_TTL_S: nothing published
        assert redis_client.ttl(KEYS.job(job_id)) <= CANCELLED_TTL_S


def test_a_cancelled_job_whose_worker_was_killed_after_its_read_ends_once_by_the_reclaim(
    redis_server, redis_client, queue
):
    """A worker read the entry and died before its claim (an XREADGROUP of a consumer that never
    comes back): the entry is pending, so the cancel leaves it, and it no longer counts as waiting.
    A live worker reclaims it past claim_idle_ms, its CLAIM finds the job ended, and it acknowledges
    and deletes the entry and gives the keys its result_ttl_s: the job ended once, cancelled."""
    stream = KEYS.queue(queue)
    with Client(redis_server.url, queue) as client:
        job_id = client.submit("x", max_tokens=2)
        redis_client.xgroup_create(stream, GROUP, "0", mkstream=True)
        assert redis_client.xreadgroup(GROUP, "killed", {stream: ">"}, count=1)
        assert client.cancel(job_id).status == "cancelled"
        assert (redis_client.xlen(stream), unread(redis_client, stream)) == (1, 0)  # left to its reader
        with serving(
            redis_server.url, queue, 0.001, claim_idle_ms=400, reclaim_interval_s=0.05, result_ttl_s=RESULT_TTL_S
        ) as worker:
            assert eventually(lambda: redis_client.xlen(stream) == 0, 20)
            assert not outcome_count(worker, "done")
        assert client.result(job_id, timeout=5).status == "cancelled"
        assert 0 < redis_client.ttl(KEYS.job(job_id)) <= RESULT_TTL_S


def test_cancels_racing_a_workers_reads_end_each_job_once_and_leave_nothing_counted(
    redis_server, redis_client, client_kind, queue, tenant
):
    """A worker of two slots serves a tenant's backlog of jobs that never end by themselves
    (HoldingEchoEngine) while another thread cancels every one of them, over many of the worker's
    read intervals: each job ends once, cancelled (queued or running), the worker finishes none,
    and afterwards no stream holds an entry, none is pending, every job key goes within the
    worker's result_ttl_s, and the tenant's whole quota is free again."""
    jobs = 24
    client = make_client(client_kind, redis_server.url, queue, tenant=tenant)
    canceller = Client(redis_server.url, queue)
    try:
        set_max_waiting(redis_server.url, queue, tenant, jobs)
        intervals = {"checkpoint_interval_s": 0.1, "stream_interval_s": 0.05, "result_ttl_s": RESULT_TTL_S}
        engine = {"max_running": 2}
        with serving(
            redis_server.url, queue, 0.005, engine_class=HoldingEchoEngine, engine=engine, **intervals
        ) as worker:
            ids = [client.submit("x" * 200, max_tokens=200, service_tier=LANES[i % 3]) for i in range(jobs)]
            assert eventually(lambda: worker.holdings.running)  # the cancels meet running jobs too
            cancels = threading.Thread(target=lambda: [canceller.cancel(j) or time.sleep(0.02) for j in ids])
            cancels.start()
            cancels.join(timeout=60)
            results = [client.result(job_id, timeout=30) for job_id in ids]
            assert [r.status for r in results] == ["cancelled"] * jobs
            assert not outcome_count(worker, "done")
            started = [r for r in results if r.usage.completion_tokens > 0]
            assert 0 < len(started) < jobs  # both kinds of cancel: of a running job, of a queued one
            streams = tenant_streams(queue, tenant)
            assert eventually(lambda: sum(redis_client.xlen(s) for s in streams) == 0)
        for job_id in ids:
            ttls = [redis_client.ttl(key) for key in job_keys(KEYS, job_id) if redis_client.exists(key)]
            assert all(0 < ttl <= RESULT_TTL_S for ttl in ttls), (job_id, ttls)
        again = [client.submit("y", max_tokens=1) for _ in range(jobs)]  # the whole quota, no worker
        assert sum(unread(redis_client, s) for s in streams) == jobs
        assert [client.status(job_id).status for job_id in again] == ["queued"] * jobs
    finally:
        client.close()
        canceller.close()
