"""The sharing rules through the real client and the queue loop (echo engine) on a real
redis-server: lanes and tenants from submit to result, a higher lane's job preempting lower lanes'
running work, fair shares between tenants, the waiting quota, the rate limits, bad input refused
before anything is enqueued, and lane jobs surviving a worker's kill -9 and their dead letters'
retry."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
import urllib.request
import uuid
from contextlib import ExitStack

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.echo_workers import GatedWorker, SlowEchoEngine, serving
from harness.polling import eventually
from producer_client import (
    AsyncClient,
    Client,
    InvalidArgument,
    InvalidQueueStream,
    QueueFull,
    RateLimited,
    WaitingQuotaExceeded,
)
from producer_client.keys import GROUP, PROTOCOL_VERSION, Keys
from producer_client.quotas import Quota
from producer_client.tenant_labels import MAX_TENANT_LABELS, OTHER_TENANTS
from producer_client.waiting import MAX_BLOCK_MS
from tests.support.clients import make_client

pytestmark = pytest.mark.waits

KEYS = Keys()
FAST_RECLAIM = dict(claim_idle_ms=500, reclaim_interval_s=0.05)


@pytest.fixture
def tenant():
    return f"t{uuid.uuid4().hex[:8]}"


def test_a_tenants_job_in_each_lane_runs_from_its_lanes_stream(redis_server, client_kind, queue, tenant, redis_client):
    client = make_client(client_kind, redis_server.url, queue, tenant=tenant)
    try:
        with serving(redis_server.url, queue):
            ids = {tier: client.submit(f"{tier} job", max_tokens=3, service_tier=tier) for tier in ("priority", "flex")}
            ids["auto"] = client.submit("auto job", max_tokens=3, service_tier="auto")
            results = {tier: client.result(job_id, timeout=10) for tier, job_id in ids.items()}
    finally:
        client.close()
    assert {tier: r.text for tier, r in results.items()} == {"priority": "pri", "flex": "fle", "auto": "aut"}
    assert (
        redis_client.exists(*(KEYS.lane_stream(queue, lane, tenant) for lane in ("priority", "default", "flex"))) == 3
    )
    assert redis_client.xlen(KEYS.queue(queue)) == 0
    assert redis_client.smembers(KEYS.lane_streams(queue)) == {
        f"{lane}:{tenant}" for lane in ("priority", "default", "flex")
    }


def test_the_ids_a_client_makes_for_a_tenants_jobs_carry_the_tenant(redis_server, client_kind, queue, tenant):
    """submit, submit_many and generate of a tenant's client make ids `<tenant>.<32 hex>` (what the
    gateway tells an API key's jobs by); a request_id stays as given, and a client of no tenant's
    ids are 32 hex digits, as before."""
    client = make_client(client_kind, redis_server.url, queue, tenant=tenant)
    untenanted = make_client(client_kind, redis_server.url, queue)
    try:
        with serving(redis_server.url, queue):
            made = [client.submit("one", max_tokens=1), *client.submit_many([{"prompt": "two", "max_tokens": 1}] * 2)]
            made.append(client.generate("three", max_tokens=1, timeout=10).id)
            named = client.submit("four", max_tokens=1, request_id=f"mine-{tenant}")
            plain = untenanted.submit("five", max_tokens=1)
            assert [client.result(job_id, timeout=10).status for job_id in [*made, named, plain]] == ["done"] * 6
    finally:
        client.close()
        untenanted.close()
    assert all(re.fullmatch(rf"{tenant}\.[0-9a-f]{{32}}", job_id) for job_id in made), made
    assert (named, re.fullmatch("[0-9a-f]{32}", plain) is not None) == (f"mine-{tenant}", True)


def test_queue_stats_count_every_lanes_stream_and_name_each(redis_server, queue, tenant):
    with Client(redis_server.url, queue) as client:  # no worker: everything waits
        client.submit("no tenant", max_tokens=1)
        client.as_tenant(tenant).submit_many([{"prompt": "flex", "service_tier": "flex"}] * 2)
        stats = client.queue_stats()
    assert (stats.depth, stats.pending, stats.waiting) == (3, 0, 3)
    assert [(s.lane, s.tenant, s.depth, s.waiting) for s in stats.streams] == [
        ("default", None, 1, 1),
        ("flex", tenant, 2, 2),
    ]


def test_queue_stats_read_a_set_of_lane_streams_and_a_scheduler_hash_of_another_type_as_missing(
    redis_server, queue, tenant, redis_client
):
    """Producers may write both (the scripts make them anew at the next enqueue or reclaim): stats,
    the board and the gateway's metrics raised WRONGTYPE meanwhile."""
    with Client(redis_server.url, queue) as client:
        client.submit("no tenant", max_tokens=1)
        for key in (KEYS.lane_streams(queue), KEYS.scheduler(queue)):
            redis_client.delete(key)
            redis_client.xadd(key, {"not": "ours"})
        stats = client.queue_stats()
    assert (stats.depth, [(s.lane, s.tenant, s.depth) for s in stats.streams]) == (1, [("default", None, 1)])


def test_a_job_stream_of_another_type_reads_as_empty_to_stats_listings_and_the_board(
    redis_server, queue, tenant, redis_client
):
    """A producer may DEL and SET the queue's own stream or a tenant's lane stream: XLEN's
    WRONGTYPE failed the whole of `mili stats`, `mili jobs`, the board and the gateway's metrics for
    every stream of the queue. Its jobs went with the DEL, so it reads as empty, and the queue's
    other streams are read as ever."""
    with Client(redis_server.url, queue, tenant=tenant) as client:
        flex = client.submit("flex job", max_tokens=1, service_tier="flex")
        client.submit("priority job", max_tokens=1, service_tier="priority")
        client.as_tenant(None).submit("no tenant", max_tokens=1)
        for key in (KEYS.queue(queue), KEYS.lane_stream(queue, "priority", tenant)):
            redis_client.delete(key)
            redis_client.set(key, "not a stream")
        stats = client.queue_stats()
        waiting = client.inspect.waiting(limit=10)
        running = client.inspect.running(limit=10)
        overview = client.inspect.overview()
    assert (stats.depth, [(s.lane, s.tenant, s.depth) for s in stats.streams]) == (1, [("flex", tenant, 1)])
    assert [job.job_id for job in waiting] == [flex] and running == []
    assert (overview.depth, overview.waiting, overview.processed) == (1, 1, 0)


def test_a_worker_counts_the_tokens_it_served_per_lane_and_tenant(redis_server, queue, tenant):
    with Client(redis_server.url, queue, tenant=tenant) as client, serving(redis_server.url, queue) as worker:
        flex = [client.submit(f"flex job {i}", max_tokens=3, service_tier="flex") for i in range(3)]
        plain = client.as_tenant(None).submit("plain job", max_tokens=2)
        results = {j: client.result(j, timeout=10) for j in [*flex, plain]}

        def served(lane: str, name: str) -> float | None:
            return worker.metrics.registry.get_sample_value("mili_served_tokens_total", {"lane": lane, "tenant": name})

        tokens = {j: r.usage.prompt_tokens + r.usage.completion_tokens for j, r in results.items()}
        expected = (sum(tokens[j] for j in flex), tokens[plain])
        # The heartbeat (every 0.05 s here) hands the ledger's counts to the metrics.
        assert eventually(lambda: (served("flex", tenant), served("default", "")) == expected), (
            served("flex", tenant),
            served("default", ""),
            expected,
        )


def test_a_worker_exports_a_bounded_number_of_tenant_series_and_counts_the_rest_as_other(redis_server, queue, caplog):
    """Tenants are names producers choose: one series each let a careless or hostile producer grow
    a worker's /metrics (and Prometheus's memory) without end. Past MAX_TENANT_LABELS tenants, the
    rest count under OTHER_TENANTS, every token still counted, said in one log line."""
    names = [f"t{i:03d}-{uuid.uuid4().hex[:6]}" for i in range(MAX_TENANT_LABELS + 7)]
    with Client(redis_server.url, queue) as client, serving(redis_server.url, queue) as worker:
        server, port = worker.metrics.serve("127.0.0.1", 0)
        try:
            with caplog.at_level(logging.WARNING, logger="worker.metrics"):
                jobs = [client.as_tenant(name).submit(f"job of {name}", max_tokens=1) for name in names]
                results = [client.result(job_id, timeout=20) for job_id in jobs]
                expected = sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in results)
                # The heartbeat (every 0.05 s here) hands the ledger's counts to the metrics.
                assert eventually(lambda: sum(served_by_tenant(port).values()) == expected), expected
            scraped = served_by_tenant(port)
        finally:
            server.shutdown()
            server.server_close()
    assert set(scraped) <= {*names, OTHER_TENANTS}
    assert len(scraped) == MAX_TENANT_LABELS + 1 and scraped[OTHER_TENANTS] > 0
    past_cap = [r for r in caplog.records if OTHER_TENANTS in r.getMessage()]
    assert len(past_cap) == 1


def served_by_tenant(port: int) -> dict[str, float]:
    """A worker's mili_served_tokens_total by tenant, scraped from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        families = text_string_to_metric_families(answer.read().decode())
    (served,) = [f for f in families if f.name == "mili_served_tokens"]
    return {s.labels["tenant"]: s.value for s in served.samples if s.name == "mili_served_tokens_total"}


def test_bad_lanes_and_tenants_are_refused_before_anything_is_enqueued(redis_server, queue, redis_client):
    with pytest.raises(InvalidArgument) as bad:
        Client(redis_server.url, queue, tenant="a:b")
    assert bad.value.field == "tenant"
    with Client(redis_server.url, queue, tenant="team-a") as client:
        with pytest.raises(InvalidArgument) as bad:
            client.submit("x", service_tier="gold")
        assert bad.value.field == "service_tier"
        with pytest.raises(InvalidArgument) as bad:
            client.submit_many([{"prompt": "x"}, {"prompt": "y", "service_tier": "scale"}])
        assert bad.value.field == "jobs[1].service_tier"
        refused = [({"weight": w}, "weight") for w in (0, 1e-300, 0.0009, 1000.5, float("inf"), float("nan"))]
        refused += [({"rpm": 0}, "rpm"), ({"max_waiting": -1}, "max_waiting")]
        for settings, field in refused:
            with pytest.raises(InvalidArgument) as bad:
                client.tenant_quotas.set("team-a", **settings)
            assert bad.value.field == field
    assert redis_client.keys(f"*{queue}*") == []
    assert not redis_client.exists(KEYS.quota("team-a"))


def test_a_priority_job_preempts_a_worker_full_of_flex_jobs(redis_server, queue, tenant):
    """Two slots, both running long flex jobs: a priority job starts at once, preempting one of
    them, which then finishes with its whole output."""
    with Client(redis_server.url, queue, tenant=tenant) as client:
        with serving(redis_server.url, queue, step_s=0.01, engine={"max_running": 2}) as worker:
            flex = [client.submit("f" * 200, max_tokens=200, service_tier="flex") for _ in range(2)]
            assert eventually(lambda: len(worker.holdings.running) == 2)
            urgent = client.submit("urgent", max_tokens=3, service_tier="priority")
            result = client.result(urgent, timeout=10)
            slow = [client.result(job_id, timeout=20) for job_id in flex]
    assert result.text == "urg"
    assert all(r.status == "done" and r.text == "f" * 200 for r in slow)
    assert result.timings.finished_at < min(r.timings.finished_at for r in slow)
    assert result.timings.first_token_at - result.timings.queued_at < 1.0  # not the flex jobs' 2 s
    assert worker.engine.preemptions >= 1


class HeldEchoEngine(SlowEchoEngine):
    """An echo engine whose steps wait while `gate` is closed (each says so: `held`), let through one
    at a time by `one_step`, and that notes its step count when each job is added to it."""

    def __init__(self, *args):
        super().__init__(*args)
        self.gate, self.held = threading.Event(), threading.Event()
        self.gate.set()
        self.added_at_step: dict[str, int] = {}

    def step(self):
        while not self.gate.wait(0.005):
            self.held.set()
        return super().step()

    def one_step(self) -> None:
        """Let the held step run, and wait until the next one is held (an iteration later)."""
        self.held.clear()
        self.gate.set()  # wakes the held step, which runs though the gate closes again at once
        self.gate.clear()
        assert self.held.wait(5)

    def add_request(self, request_id, *args, **kwargs):
        self.added_at_step.setdefault(request_id.job_id, self.stats().steps)
        super().add_request(request_id, *args, **kwargs)


def test_a_worker_full_of_default_jobs_takes_a_priority_job_in_the_iteration_after_it_arrives(
    redis_server, queue, tenant
):
    """Two slots running long default jobs: while no priority job waits the worker only looks for
    one each iteration (an EXISTS, not a READ). A priority job that arrives while a step runs is
    added to the engine right after that step, before the next (the iteration's read follows its
    step and publication), in two iterations running, and each preempts a default job, which still
    ends whole."""
    with Client(redis_server.url, queue, tenant=tenant) as client:
        with serving(
            redis_server.url, queue, step_s=0.01, engine_class=HeldEchoEngine, engine={"max_running": 2}
        ) as worker:
            engine = worker.engine
            default = [client.submit("d" * 100, max_tokens=100) for _ in range(2)]
            assert eventually(lambda: len(worker.holdings.running) == 2)
            engine.gate.clear()
            assert engine.held.wait(5)
            urgent, added_after = [], []
            for _ in range(2):
                steps = engine.stats().steps  # the held step's not counted yet
                urgent.append(client.submit("urgent", max_tokens=3, service_tier="priority"))
                engine.one_step()
                added = engine.added_at_step.get(urgent[-1])
                added_after.append(None if added is None else added - steps)
            engine.gate.set()
            results = [client.result(job_id, timeout=10) for job_id in urgent]
            slow = [client.result(job_id, timeout=20) for job_id in default]
    assert added_after == [1, 1]
    assert [r.text for r in results] == ["urg", "urg"]
    assert engine.preemptions == 2
    assert [(r.status, r.text) for r in slow] == [("done", "d" * 100)] * 2
    assert max(r.timings.finished_at for r in results) < min(r.timings.finished_at for r in slow)


def test_a_default_job_that_arrives_while_flex_entries_are_claimed_starts_before_the_next_step(
    redis_server, queue, tenant
):
    """A flex job's entry is read; while the worker prepares its claim (its prompt tokenized, the
    CLAIM not yet sent) a default job arrives. The claim's look at the higher lanes finds it, so it
    is read and added to the engine in the same iteration, before the step that runs the flex job
    first: not an iteration later, after that step, its publication and the next READ (behind a
    flex flood, that iteration was most of a default job's wait)."""
    with Client(redis_server.url, queue, tenant=tenant) as client, Client(redis_server.url, queue, tenant=tenant) as b:
        with serving(redis_server.url, queue, step_s=0.01, engine_class=HeldEchoEngine) as worker:
            engine = worker.engine
            encode = engine.tokenizer.encode
            arrived: list[str] = []

            def arriving(text, *args, **kwargs):  # in the worker's admission, before the CLAIM
                if text == "flex" and not arrived:
                    arrived.append(b.submit("default", max_tokens=3))
                return encode(text, *args, **kwargs)

            engine.tokenizer.encode = arriving
            flex = client.submit("flex", max_tokens=3, service_tier="flex")
            assert client.result(flex, timeout=10).text == "fle"
            assert b.result(arrived[0], timeout=10).text == "def"
    assert engine.added_at_step[arrived[0]] == engine.added_at_step[flex]


def test_tenants_of_a_lane_share_a_worker_by_tokens_not_by_jobs_sent(redis_server, queue):
    """One slot: a sent 8 jobs before b sent 2; b's run second and fourth, not after a's eight."""
    with ExitStack() as stack:
        a = stack.enter_context(Client(redis_server.url, queue, tenant="a"))
        b = stack.enter_context(Client(redis_server.url, queue, tenant="b"))
        a_ids = [a.submit(f"a{i}", max_tokens=2) for i in range(8)]
        b_ids = [b.submit(f"b{i}", max_tokens=2) for i in range(2)]
        stack.enter_context(serving(redis_server.url, queue, step_s=0.005, engine={"max_running": 1}))
        results = [a.result(job_id, timeout=10) for job_id in a_ids + b_ids]
    order = [r.text[0] for r in sorted(results, key=lambda r: r.timings.started_at)]
    assert order == ["a", "b", "a", "b", "a", "a", "a", "a", "a", "a"]


def test_the_counters_hold_what_each_tenant_was_served(redis_server, queue, redis_client):
    """Charged an estimate at read, corrected to the tokens served once each job ends."""
    with ExitStack() as stack:
        a = stack.enter_context(Client(redis_server.url, queue, tenant="a"))
        stack.enter_context(serving(redis_server.url, queue))
        a.tenant_quotas.set("a", weight=2.0)
        time.sleep(1.1)  # the client's copy of a's quota is read again
        ids = [a.submit("x" * 10, max_tokens=4) for _ in range(3)]
        [a.result(job_id, timeout=10) for job_id in ids]
        ids = [a.submit("y" * 6, max_tokens=2) for _ in range(2)]  # their read carries the corrections
        [a.result(job_id, timeout=10) for job_id in ids]
        served = 3 * (10 + 4) + 2 * (6 + 2)

        def counter():
            saved = redis_client.hget(KEYS.scheduler(queue), "c:default:a")
            return saved is not None and float(saved)

        # The last two jobs' corrections ride with a later read: the idle worker's next one.
        stack.enter_context(Client(redis_server.url, queue, tenant="z")).submit("z", max_tokens=1)
        assert eventually(lambda: counter() == served / 2), counter()


def test_a_tenants_flood_fills_its_own_quota_and_stream_and_refuses_nobody_else(redis_server, queue):
    with ExitStack() as stack:
        a = stack.enter_context(Client(redis_server.url, queue, tenant="a", max_queue_depth=5))
        b = stack.enter_context(Client(redis_server.url, queue, tenant="b", max_queue_depth=5))
        plain = stack.enter_context(Client(redis_server.url, queue, max_queue_depth=5))
        a.tenant_quotas.set("a", max_waiting=3)
        a.submit_many([{"prompt": "a", "service_tier": tier} for tier in ("flex", "default", "priority")])
        with pytest.raises(WaitingQuotaExceeded) as over:
            a.submit("a4")
        assert isinstance(over.value, QueueFull) and "max_waiting quota is 3" in over.value.message
        with pytest.raises(WaitingQuotaExceeded) as over:
            a.submit_many([{"prompt": "a5"}])
        assert over.value.job_ids == []
        b.submit_many([{"prompt": "b"}] * 5)  # b has no quota: only its stream's bound
        with pytest.raises(QueueFull):
            b.submit("b6")
        plain.submit("no tenant")  # the queue's own stream has its own bound


def test_a_rate_limit_refuses_past_its_bucket_and_says_when_to_retry(redis_server, queue, tenant):
    with Client(redis_server.url, queue, tenant=tenant) as client:
        client.tenant_quotas.set(tenant, rpm=3, tpm=1000)
        submitted = [client.submit_rated(prompt="x" * 40, max_tokens=90) for _ in range(3)]
        assert [s.limits.remaining_requests for s in submitted] == [2, 1, 0]
        assert [s.limits.remaining_tokens for s in submitted] == [900, 800, 700]
        assert submitted[-1].limits.limit_requests == 3 and 59 < submitted[-1].limits.reset_requests_s <= 60
        with pytest.raises(RateLimited) as limited:
            client.submit("x" * 40, max_tokens=90)
        assert (limited.value.which, limited.value.limit) == ("requests", 3)
        assert 19 < limited.value.reset_s <= 20  # a request drips back every 20 s
        with pytest.raises(InvalidArgument) as large:
            client.submit("x", max_tokens=1000)
        assert large.value.field == "max_tokens"
        # The tenant named last: "tenant 'team-z''s limit" read as a quote left open.
        assert large.value.message.endswith(f"exceed the limit of 1000 tokens per minute of tenant {tenant!r}")
        client.tenant_quotas.set(tenant, unset=("rpm", "tpm"))
        time.sleep(1.1)
        assert client.submit_rated(prompt="x").limits.limit_requests == 0


@pytest.mark.parametrize(
    "junk",
    [{"type": "string"}, {"r": "zz", "t": "nan"}, {"r": "inf", "t": "-inf"}],
    ids=["another type", "no number", "not finite"],
)
def test_a_producers_junk_in_a_tenants_rate_hash_reads_as_a_full_bucket(
    redis_server, queue, tenant, redis_client, junk
):
    """Producers write the rate hash (their enqueue script keeps it): a key of another type, or a
    time that is no finite number, raised WRONGTYPE or a Lua error from every submit of the tenant
    and from the gateway's headers. It reads as a full bucket, and the submit writes it anew."""
    rate = KEYS.rate(queue, tenant)
    if junk == {"type": "string"}:
        redis_client.set(rate, "x")
    else:
        redis_client.hset(rate, mapping=junk)
    with Client(redis_server.url, queue, tenant=tenant) as client:
        client.tenant_quotas.set(tenant, rpm=3, tpm=1000)
        assert (client.rate_limits().remaining_requests, client.rate_limits().remaining_tokens) == (3, 1000)
        submitted = client.submit_rated(prompt="x", max_tokens=9)
        assert (submitted.limits.remaining_requests, submitted.limits.remaining_tokens) == (2, 990)
        assert client.rate_limits().remaining_requests == 2
        assert redis_client.type(rate) == "hash" and float(redis_client.hget(rate, "r")) > 0
        client.tenant_quotas.set(tenant, unset=("rpm", "tpm"))


def test_a_tenants_settings_key_of_another_type_holds_no_setting(redis_server, queue, tenant, redis_client):
    """As a settings field that does not read counts as unset: the tenant submits, unlimited,
    and its quota lists as none, where WRONGTYPE came from each of its submits."""
    redis_client.set(KEYS.quota(tenant), "x")
    redis_client.zadd(KEYS.quotas(), {tenant: 0})
    try:
        with Client(redis_server.url, queue, tenant=tenant) as client:
            assert client.submit_rated(prompt="x", max_tokens=2).limits.limit_requests == 0
            assert client.tenant_quotas.get(tenant) == Quota()
            assert tenant not in client.tenant_quotas.all()  # as a tenant with no setting left
    finally:
        redis_client.delete(KEYS.quota(tenant))
        redis_client.zrem(KEYS.quotas(), tenant)


@pytest.mark.parametrize("limits", [{}, {"max_waiting": 5}])
def test_a_tenants_lane_stream_of_another_type_refuses_its_submits_there_alone(
    redis_server, queue, tenant, redis_client, limits
):
    """A producer may write a tenant's lane stream: its jobs went with the DEL that changed its
    type, so it cannot be made anew. A submit there raised a raw WRONGTYPE (the gateway's 503, which
    the SDKs retry); now InvalidQueueStream, with nothing of the job left, and the tenant's other
    lanes, other tenants' same lane and the count of its waiting jobs go on."""
    flex = KEYS.lane_stream(queue, "flex", tenant)
    redis_client.hset(flex, "not", "a stream")
    with Client(redis_server.url, queue, tenant=tenant, placement=False) as client:
        if limits:
            client.tenant_quotas.set(tenant, **limits)
        try:
            with pytest.raises(InvalidQueueStream) as refused:
                client.submit(prompt="x", max_tokens=2, service_tier="flex")
            assert (refused.value.code, refused.value.lane, refused.value.tenant) == (
                "invalid_queue_stream",
                "flex",
                tenant,
            )
            with pytest.raises(InvalidQueueStream):
                client.submit_many([{"prompt": "x", "service_tier": "flex"}])
            assert redis_client.keys(KEYS.job(f"{tenant}.*")) == []  # no hash left of the jobs refused
            kept = client.submit(prompt="x", max_tokens=2, service_tier="default")
            other = client.as_tenant("other-" + tenant).submit(prompt="x", max_tokens=2, service_tier="flex")
            assert [client.status(job_id).status for job_id in (kept, other)] == ["queued", "queued"]
        finally:
            if limits:
                client.tenant_quotas.set(tenant, unset=tuple(limits))
    assert redis_client.hgetall(flex) == {"not": "a stream"}


def test_the_queues_own_stream_of_another_type_refuses_its_submits_alone(redis_server, queue, tenant, redis_client):
    """The default lane's stream of no tenant is the queue's own (ENQUEUE, ENQUEUE_MANY): the same
    InvalidQueueStream, where a raw WRONGTYPE came, and a tenant's lane submit goes in."""
    redis_client.hset(KEYS.queue(queue), "not", "a stream")
    jobs_before = set(redis_client.keys(KEYS.job("*")))
    with Client(redis_server.url, queue, placement=False) as client:
        for submit in (lambda: client.submit(prompt="x", max_tokens=2), lambda: client.submit_many([{"prompt": "x"}])):
            with pytest.raises(InvalidQueueStream) as refused:
                submit()
            assert (refused.value.lane, refused.value.tenant) == ("default", "-")
        assert set(redis_client.keys(KEYS.job("*"))) == jobs_before  # no hash left of the jobs refused
        job_id = client.as_tenant(tenant).submit(prompt="x", max_tokens=2, service_tier="flex")
        assert client.status(job_id).status == "queued"
    assert redis_client.hgetall(KEYS.queue(queue)) == {"not": "a stream"}


def test_generate_on_an_unbounded_queue_whose_stream_is_of_another_type_is_refused_at_once(
    redis_server, queue, redis_client
):
    """With no bound (max_queue_depth=None) generate() sends its first blocking read of the job's
    end in the enqueue's round trip: the enqueue refused (its stream of another type), the read
    waited out its block (2 s) for a job never enqueued before InvalidQueueStream came. The client
    now drops the connection rather than wait for it, and the job's hash goes as before; the
    asyncio client too."""
    redis_client.hset(KEYS.queue(queue), "not", "a stream")
    jobs_before = set(redis_client.keys(KEYS.job("*")))
    with Client(redis_server.url, queue, placement=False, max_queue_depth=None) as client:
        started = time.monotonic()
        with pytest.raises(InvalidQueueStream):
            client.generate("x", max_tokens=2, timeout=4 * MAX_BLOCK_MS / 1000)
        took = time.monotonic() - started
        assert client.queue_stats().depth == 0  # the connection dropped is made anew for the next call

    async def agenerate() -> float:
        client = AsyncClient(redis_server.url, queue, placement=False, max_queue_depth=None)
        try:
            started = time.monotonic()
            with pytest.raises(InvalidQueueStream):
                await client.generate("x", max_tokens=2, timeout=4 * MAX_BLOCK_MS / 1000)
            return time.monotonic() - started
        finally:
            await client.aclose()

    took_async = asyncio.run(agenerate())
    assert max(took, took_async) < MAX_BLOCK_MS / 1000 * 0.75, (took, took_async)
    assert set(redis_client.keys(KEYS.job("*"))) == jobs_before


def test_lane_jobs_of_a_killed_worker_are_reclaimed_and_each_ends_once(redis_server, queue, tenant, redis_client):
    with ExitStack() as stack:
        client = stack.enter_context(Client(redis_server.url, queue, tenant=tenant))
        victim = stack.enter_context(
            serving(
                redis_server.url, queue, step_s=0.01, worker_class=GatedWorker, name=f"victim-{queue}", **FAST_RECLAIM
            )
        )
        ids = [
            client.submit(f"job {i} " * 10, max_tokens=60, service_tier=tier)
            for i, tier in enumerate(["flex", "priority", "default"] * 2)
        ]
        assert eventually(lambda: len(victim.holdings.running) == 6)
        victim.killed = True
        victim.gate.clear()
        survivor = stack.enter_context(
            serving(redis_server.url, queue, step_s=0.002, name=f"survivor-{queue}", **FAST_RECLAIM)
        )
        results = [client.result(job_id, timeout=20) for job_id in ids]
        victim.gate.set()
    assert all(r.status == "done" and r.worker == survivor.name for r in results)
    assert [r.text for r in results] == [(f"job {i} " * 10)[:60] for i in range(6)]
    for lane in ("priority", "default", "flex"):
        stream = KEYS.lane_stream(queue, lane, tenant)
        assert redis_client.xpending(stream, GROUP)["pending"] == 0 and redis_client.xlen(stream) == 0


def test_an_idle_worker_wakes_for_a_lanes_job_at_once(redis_server, queue, tenant):
    """Idle, the worker blocks on the queue's stream and the doorbell: a tenant's job (in its lane's
    stream) starts well within the block (1.5 s). The queue's first lane job makes the doorbell,
    which the worker was not blocked on yet: it waits for the block's end, once."""
    with ExitStack() as stack:
        client = stack.enter_context(Client(redis_server.url, queue, tenant=tenant))
        stack.enter_context(
            serving(redis_server.url, queue, block_ms=1500, heartbeat_interval_s=2.0, claim_idle_ms=5000)
        )
        time.sleep(0.3)
        waits = []
        for tier in ("default", "flex", "priority", "default", "flex"):
            result = client.result(client.submit("hi", max_tokens=1, service_tier=tier), timeout=10)
            waits.append(result.timings.started_at - result.timings.queued_at)
            time.sleep(0.2)
    assert waits[0] < 1.5 + 0.3 and max(waits[1:]) < 0.3, waits


def test_a_dead_lane_job_is_retried_into_its_lane(redis_server, queue, tenant, redis_client):
    job_id = f"dead-{queue}"
    body = '{"prompt": "poison", "params": {"max_tokens": 2}}'
    letter = {"id": job_id, "v": str(PROTOCOL_VERSION), "body": body, "cost": "9", "lane": "flex", "tenant": tenant}
    redis_client.xadd(KEYS.dead(queue), letter)  # as a worker writes it after too many deliveries
    with Client(redis_server.url, queue) as client:
        assert client.dead_letters.retry(job_id).outcome == "retried"
        stream = KEYS.lane_stream(queue, "flex", tenant)
        assert [f for _, f in redis_client.xrange(stream)] == [
            {"id": job_id, "v": str(PROTOCOL_VERSION), "body": body, "cost": "9"}
        ]
        with serving(redis_server.url, queue):
            assert client.result(job_id, timeout=10).text == "po"
