"""A cancelled queued job stops counting at once: its entry leaves its stream, so the stream's
bound (`max_queue_depth`), the tenant's waiting quota (`max_waiting`) and `queue_stats` no longer
count it, on a queue no worker serves as on a busy one; whichever client cancels it; and a cancel
that races a worker's read ends the job once, as cancelled, with nothing left counted. Real
redis-server, the real clients, the queue loop on the echo engine."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from harness.echo_workers import HoldingEchoEngine, outcome_count, serving
from harness.polling import eventually
from producer_client import Client, QueueFull, WaitingQuotaExceeded
from producer_client.keys import GROUP, LANES, Keys
from producer_client.protocol import producer as scripts
from producer_client.protocol.script import ScriptCall
from tests.support.clients import make_client

pytestmark = pytest.mark.waits

KEYS = Keys()
N = 3


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


def record(redis_client, queue: str, job_id: str, entry_id: str, stream: str) -> None:
    """Where a job's entry waits, as the enqueue scripts record it."""
    redis_client.hset(KEYS.waiting_entries(queue), job_id, f"{entry_id} {stream}")


def test_an_entry_a_worker_has_read_is_left_to_it_and_another_jobs_is_never_removed(redis_client, queue):
    stream = KEYS.queue(queue)
    ids = [uuid.uuid4().hex for _ in range(2)]
    entries = [redis_client.xadd(stream, {"id": job_id, "v": "2", "body": "{}"}) for job_id in ids]
    redis_client.xgroup_create(stream, GROUP, "0")
    redis_client.xreadgroup(GROUP, "w", {stream: ">"}, count=1)  # the first is read: pending
    remove = scripts.remove_entry
    record(redis_client, queue, ids[0], entries[0], stream)
    assert run_call(redis_client, remove(KEYS, queue, ids[0])) == 0
    record(redis_client, queue, ids[0], entries[1], stream)  # a forged record: another job's entry
    assert run_call(redis_client, remove(KEYS, queue, ids[0])) == 0
    record(redis_client, queue, ids[1], entries[1], KEYS.queue(f"{queue}x"))  # another queue's stream
    assert run_call(redis_client, remove(KEYS, queue, ids[1])) == 0
    assert redis_client.xlen(stream) == 2
    record(redis_client, queue, ids[1], entries[1], stream)
    assert run_call(redis_client, remove(KEYS, queue, ids[1])) == 1
    assert run_call(redis_client, remove(KEYS, queue, ids[1])) == 0  # twice: once
    assert redis_client.xlen(stream) == 1 and unread(redis_client, stream) == 0
    assert redis_client.exists(KEYS.waiting_entries(queue)) == 0  # each record went with its remove
    assert KEYS.queue_and_waiting_entries(queue) == (stream, KEYS.waiting_entries(queue))  # ENQUEUE's keys


@pytest.mark.parametrize("route", ["queue stream", "lanes"])
def test_no_record_of_where_an_entry_waits_outlives_its_read(redis_server, redis_client, client_kind, queue, route):
    """The leak bound: jobs submitted (one by one and with submit_many) to a bounded queue, read by
    a worker's READ and by its idle wait (the queue's own stream), run and settled: the queue's
    record hash is empty. A record lives only while its entry waits unread."""
    tenant = {"tenant": "t1"} if route == "lanes" else {}
    client = make_client(client_kind, redis_server.url, queue, max_queue_depth=1000, **tenant)
    try:
        with serving(redis_server.url, queue, 0.001):
            ids = [client.submit("x", max_tokens=2) for _ in range(10)]
            ids += client.submit_many([{"prompt": "y", "max_tokens": 2}] * 20)
            for _ in range(5):  # an idle worker's wait reads these
                time.sleep(0.05)
                ids.append(client.submit("z", max_tokens=2))
            assert [client.result(job_id, timeout=30).status for job_id in ids] == ["done"] * len(ids)
            assert eventually(lambda: redis_client.exists(KEYS.waiting_entries(queue)) == 0)
        assert client.queue_stats().depth == 0
    finally:
        client.close()


def test_cancels_racing_a_workers_reads_end_each_job_once_and_leave_nothing_counted(
    redis_server, redis_client, client_kind, queue, tenant
):
    """A worker of two slots serves a tenant's backlog of jobs that never end by themselves
    (HoldingEchoEngine) while another thread cancels
    every one of them, over many of the worker's read intervals: each job ends once, cancelled
    (queued or running), the worker counts each it dropped or stopped once, and afterwards no
    stream holds an entry, none is pending, and the tenant's whole quota is free again."""
    jobs = 24
    client = make_client(client_kind, redis_server.url, queue, tenant=tenant)
    canceller = Client(redis_server.url, queue)
    try:
        set_max_waiting(redis_server.url, queue, tenant, jobs)
        intervals = {"checkpoint_interval_s": 0.1, "stream_interval_s": 0.05}
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
            # The worker stopped the ones it had started and dropped the ones it read after their
            # cancel: none ran to its end.
            assert not outcome_count(worker, "done")
            started = [r for r in results if r.usage.completion_tokens > 0]
            assert 0 < len(started) < jobs  # both kinds of cancel: of a running job, of a queued one
            streams = tenant_streams(queue, tenant)
            assert eventually(lambda: sum(redis_client.xlen(s) for s in streams) == 0)
        again = [client.submit("y", max_tokens=1) for _ in range(jobs)]  # the whole quota, no worker
        assert sum(unread(redis_client, s) for s in streams) == jobs
        assert [client.status(job_id).status for job_id in again] == ["queued"] * jobs
    finally:
        client.close()
        canceller.close()


def test_a_record_hash_of_another_type_is_made_anew_and_refuses_no_submit(redis_server, redis_client, queue):
    """A producer may write the record hash (docs/security.md): one of another type failed no
    enqueue, it is made a hash again, and the cancels free their places."""
    redis_client.set(KEYS.waiting_entries(queue), "junk")
    with Client(redis_server.url, queue, max_queue_depth=N) as client:
        ids = [client.submit("a", max_tokens=2), *client.submit_many([{"prompt": "b", "max_tokens": 2}])]
        assert redis_client.type(KEYS.waiting_entries(queue)) == "hash"
        client.cancel_many(ids)
        assert client.queue_stats().depth == 0
