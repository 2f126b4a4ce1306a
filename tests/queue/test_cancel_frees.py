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
from producer_client import Client, QueueFull, WaitingQuotaExceeded, steps
from producer_client.keys import GROUP, LANES, Keys
from producer_client.operations import record_entry
from producer_client.protocol import producer as scripts
from producer_client.protocol.producer import WaitingEntry
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


def test_a_cancel_before_the_entry_is_recorded_is_removed_by_the_record(redis_client, queue):
    """The cancel comes between the enqueue and its record (CANCEL finds no entry to name): the
    record finds the job cancelled and removes the entry itself."""
    job_id = uuid.uuid4().hex
    stream = KEYS.queue(queue)
    redis_client.hsetnx(KEYS.job(job_id), "status", "queued")
    entry_id = redis_client.xadd(stream, {"id": job_id, "v": "2", "body": "{}"})
    reply = run_call(redis_client, scripts.cancel(KEYS, job_id, '{"id": "x"}'))
    assert reply == "queued" and redis_client.xlen(stream) == 1
    steps.run(redis_client, record_entry(KEYS, job_id, WaitingEntry(stream, entry_id)))
    assert redis_client.xlen(stream) == 0
    assert "waits_at" not in redis_client.hgetall(KEYS.job(job_id))


def test_a_submit_stopped_in_its_record_leaves_no_job_behind(redis_client, queue):
    """A KeyboardInterrupt (or a task's cancel) in the record's round trip: the submit answers no
    job id, so its entry and its hash go, as a submit stopped in its enqueue leaves none."""
    job_id = uuid.uuid4().hex
    stream = KEYS.queue(queue)
    redis_client.hsetnx(KEYS.job(job_id), "status", "queued")
    entry_id = redis_client.xadd(stream, {"id": job_id, "v": "2", "body": "{}"})
    redis_client.script_load(scripts.REMOVE_ENTRY.source)
    record = record_entry(KEYS, job_id, WaitingEntry(stream, entry_id))
    next(record)
    undo = record.throw(KeyboardInterrupt())
    pipe = redis_client.pipeline(transaction=False)
    undo(pipe)
    assert pipe.execute() == [1, 1]
    with pytest.raises(KeyboardInterrupt):
        record.send([1, 1])
    assert redis_client.xlen(stream) == 0 and redis_client.exists(KEYS.job(job_id)) == 0


def test_an_entry_a_worker_has_read_is_left_to_it_and_another_jobs_is_never_removed(redis_client, queue):
    stream = KEYS.queue(queue)
    ids = [uuid.uuid4().hex for _ in range(2)]
    entries = [redis_client.xadd(stream, {"id": job_id, "v": "2", "body": "{}"}) for job_id in ids]
    redis_client.xgroup_create(stream, GROUP, "0")
    redis_client.xreadgroup(GROUP, "w", {stream: ">"}, count=1)  # the first is read: pending
    remove = scripts.remove_entry
    assert run_call(redis_client, remove(ids[0], WaitingEntry(stream, entries[0]))) == 0
    assert run_call(redis_client, remove(ids[0], WaitingEntry(stream, entries[1]))) == 0  # another job's
    assert run_call(redis_client, remove(ids[1], WaitingEntry(stream, entries[1]))) == 1
    assert run_call(redis_client, remove(ids[1], WaitingEntry(stream, entries[1]))) == 0  # twice: once
    assert redis_client.xlen(stream) == 1 and unread(redis_client, stream) == 0


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
