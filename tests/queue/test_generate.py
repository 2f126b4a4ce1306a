"""Client.generate (and AsyncClient's) in one round trip: where nothing can refuse the enqueue, the
wait's first blocking read of the job's `done` stream goes in the enqueue's pipeline; where
something can (a queue's bound, a tenant's limits), or on a cluster, generate is submit() then
wait() as before. Against a real redis-server, with in-process echo workers where a job must end;
round trips counted as the client sends them."""

from __future__ import annotations

import threading
import time
import uuid
from contextlib import ExitStack

import pytest

from harness.echo_workers import outcome_count, serving
from harness.polling import eventually
from producer_client import Client, JobExpired, JobTimeout, QueueFull, RateLimited, waiting
from producer_client.keys import Keys
from producer_client.placement import Placement
from producer_client.protocol import execution
from producer_client.quotas import Quotas
from tests.support.clients import commands_sent, make_client

pytestmark = pytest.mark.waits

KEYS = Keys()


def held(client, **caches):
    """`client` (a Client, or the AsyncClient behind a SyncView) with `caches` set on it: its
    placement view and quota copies kept for the whole test, so no refresh adds a round trip."""
    inner = getattr(client, "client", client)
    for name, value in caches.items():
        setattr(inner, name, value)
    return client


@pytest.mark.parametrize("placed", [False, True])
def test_a_generate_whose_job_ends_within_its_first_block_is_one_round_trip(
    client_kind, redis_server, queue, monkeypatch, placed
):
    """The create, the enqueue (ENQUEUE on a queue without a bound; a plain XADD on the stream of
    the worker placement chose) and the blocking read of the job's `done` stream, in one pipeline:
    the job's end comes back in it."""
    names = [f"{queue}-a", f"{queue}-b"] if placed else [f"{queue}-a"]
    with ExitStack() as stack:
        workers = [stack.enter_context(serving(redis_server.url, queue, name=n)) for n in names]
        assert eventually(lambda: all(w.queue.redis.exists(KEYS.worker(w.name)) for w in workers))
        client = make_client(client_kind, redis_server.url, queue, max_queue_depth=None, placement=placed)
        stack.callback(client.close)
        held(client, quota_cache=Quotas(cache_s=600), placement=Placement(placed, refresh_s=600))
        assert client.generate("warm up", max_tokens=4, timeout=30).text == "warm"  # reads the caches once
        sent = commands_sent(monkeypatch, client.redis)
        texts = [client.generate(f"job {i} of five", max_tokens=5, timeout=30).text for i in range(5)]
    assert texts == [f"job {i}" for i in range(5)]
    enqueue = "XADD" if placed else "EVALSHA"
    assert sent == [["HSETNX", enqueue, "XREAD"]] * 5


def test_a_generate_that_outlasts_its_first_block_reads_again_and_keeps_its_job(
    client_kind, redis_server, redis_client, queue, monkeypatch
):
    """No worker serves the queue: the first round trip enqueues and reads; the reads after it are
    the `done` stream's alone (the job was seen unended at its submit, within KEPT_S), each
    bounded (20 ms blocks here), until the caller's timeout. The job stays queued, entered once."""
    monkeypatch.setattr(waiting, "MAX_BLOCK_MS", 20)
    client = make_client(client_kind, redis_server.url, queue, max_queue_depth=None)
    try:
        held(client, quota_cache=Quotas(cache_s=600))
        client.submit("warm up", max_tokens=1)
        sent = commands_sent(monkeypatch, client.redis)
        with pytest.raises(JobTimeout):
            client.generate("nobody serves this", max_tokens=1, timeout=0.3)
    finally:
        client.close()
    assert sent[0] == ["HSETNX", "EVALSHA", "XREAD"]
    assert len(sent) >= 3 and sent[1:] == [["XREAD"]] * (len(sent) - 1)
    entries = redis_client.xrange(KEYS.queue(queue))
    assert len(entries) == 2  # the warm-up's and generate's, each once
    assert redis_client.hget(KEYS.job(entries[1][1]["id"]), "status") == "queued"


@pytest.mark.timing
def test_a_generate_of_a_job_with_a_deadline_submits_alone_and_raises_job_expired_at_it(
    client_kind, redis_server, queue, monkeypatch
):
    """A job with a deadline (timeout_s) is submitted alone, and the caller's timeout counts from
    the submit's end, as a wait()'s after a submit (a caller whose timeout is the job's own gets
    JobExpired: tests/queue/test_client.py); JobExpired comes at the job's deadline (0.3 s), not at
    the caller's timeout (30 s)."""
    client = make_client(client_kind, redis_server.url, queue, max_queue_depth=None)
    try:
        held(client, quota_cache=Quotas(cache_s=600))
        client.submit("warm up", max_tokens=1)
        sent = commands_sent(monkeypatch, client.redis)
        started = time.monotonic()
        with pytest.raises(JobExpired):
            client.generate("nobody serves this", max_tokens=1, timeout_s=0.3, timeout=30)
        assert 0.3 <= time.monotonic() - started < 3
    finally:
        client.close()
    assert sent[0] == ["EVALSHA", "EVALSHA"]  # CREATE (with its deadline) and ENQUEUE, no read
    assert sent[1] == ["XREAD"]


@pytest.mark.timing
def test_a_generate_refused_by_the_queues_bound_raises_queue_full_without_a_read(
    client_kind, redis_server, redis_client, queue, monkeypatch
):
    """A queue with a bound may refuse the job: its enqueue goes alone (a read behind a refused
    enqueue would block for a job that never runs), the refusal raises at once and the job's
    hash goes."""
    client = make_client(client_kind, redis_server.url, queue, max_queue_depth=1)
    try:
        held(client, quota_cache=Quotas(cache_s=600))
        client.submit("fills the queue", max_tokens=1)
        hashes = len(redis_client.keys(KEYS.job("*")))
        sent = commands_sent(monkeypatch, client.redis)
        started = time.monotonic()
        with pytest.raises(QueueFull):
            client.generate("refused", max_tokens=1, timeout=30)
        assert time.monotonic() - started < 1
    finally:
        client.close()
    assert sent == [["HSETNX", "EVALSHA"], ["DEL"]]
    assert len(redis_client.keys(KEYS.job("*"))) == hashes  # the refused job's went


@pytest.mark.timing
def test_a_generate_refused_by_a_rate_limit_raises_rate_limited_without_a_read(
    client_kind, redis_server, queue, monkeypatch
):
    """A tenant with limits may be refused whatever the queue's bound: no read rides with its
    enqueue, and RateLimited raises at once."""
    tenant = f"t-{uuid.uuid4().hex[:6]}"
    with Client(redis_server.url, queue) as admin:
        admin.tenant_quotas.set(tenant, rpm=1)
    client = make_client(client_kind, redis_server.url, queue, max_queue_depth=None, tenant=tenant)
    try:
        client.submit("the minute's one request", max_tokens=1)
        sent = commands_sent(monkeypatch, client.redis)
        started = time.monotonic()
        with pytest.raises(RateLimited):
            client.generate("refused", max_tokens=1, timeout=30)
        assert time.monotonic() - started < 1
    finally:
        client.close()
    assert not any("XREAD" in trip for trip in sent)
    assert sent[-1] == ["DEL"]


def test_a_generate_on_a_cluster_enqueues_then_reads(redis_cluster, queue, monkeypatch):
    """On a cluster the job's `done` stream and the stream its entry goes to lie in other slots,
    maybe on other nodes: the pipeline would be split per node, so the enqueue goes first and the
    read after it, as submit() then wait()."""
    monkeypatch.setattr(waiting, "MAX_BLOCK_MS", 20)
    with Client(redis_cluster.url, queue, max_queue_depth=None) as client:
        client.quota_cache = Quotas(cache_s=600)
        client.submit("warm up", max_tokens=1)
        sent = commands_sent(monkeypatch, client.redis)
        with pytest.raises(JobTimeout):
            client.generate("nobody serves this", max_tokens=1, timeout=0.1)
    assert sent[0] == ["HSETNX", "EVALSHA"]
    assert len(sent) >= 2 and sent[1:] == [["XREAD"]] * (len(sent) - 1)


def test_a_generate_whose_round_trip_is_cut_is_sent_again_and_its_job_runs_once(redis_server, redis_client, queue):
    """The connection is killed while the pipeline's read blocks: the client's retry policy sends
    the whole pipeline again (as it does a submit's whose reply was lost). The create finds the
    job, the second entry is dropped by the worker that finds the job taken, and the job ends
    once, with the result generate returns. The scripts are loaded first: on a server without them
    the enqueue meets NOSCRIPT, its read is dropped and made apart, and the read killed would be
    the wait's, not the pipeline's (as when this test is the first of its server)."""
    outcome: list[object] = []
    with Client(redis_server.url, queue, max_queue_depth=None) as client:
        execution.load_scripts(client.redis)
        generating = threading.Thread(
            target=lambda: outcome.append(client.generate("cut once", max_tokens=3, timeout=30)), daemon=True
        )
        generating.start()
        blocked = eventually(lambda: [c for c in redis_client.client_list() if c["cmd"] == "xread"])
        assert blocked
        redis_client.client_kill_filter(_id=blocked[0]["id"])
        assert eventually(lambda: redis_client.xlen(KEYS.queue(queue)) == 2)  # the pipeline, sent again
        with serving(redis_server.url, queue) as worker:
            generating.join(30)
            assert eventually(lambda: redis_client.xlen(KEYS.queue(queue)) == 0)  # both entries settled
            done = outcome_count(worker, "done")
    assert [r.text for r in outcome] == ["cut"]
    assert done == 1
