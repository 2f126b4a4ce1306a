"""client.inspect on a real redis-server: the waiting jobs (past the group's last-delivered id), the
running ones (the pending entries list), a queue's overview, and the workers' heartbeats judged
live, stale (past half their TTL) and gone, over several TTLs, through the worker's own heartbeat."""

from __future__ import annotations

import json
import time

import pytest

from cli.__main__ import main as mili
from producer_client import Client
from producer_client.errors import InvalidArgument
from producer_client.keys import GROUP, PROTOCOL_VERSION, Keys
from producer_client.validation import DEFAULT_LIMIT
from tests.queue.test_dead_letters import make_poison, settle, take
from tests.support.clients import make_client
from tests.support.fixtures import on_modes
from worker.embedded_redis import EmbeddedRedis, free_port
from worker.loop.worker_queue import WorkerQueue

KEYS = Keys()


@pytest.mark.timing
def test_waiting_and_running_jobs_come_from_the_stream_and_the_pending_list(client, redis_client, queue):
    jobs = [client.submit(f"job {i}", max_tokens=4) for i in range(4)]
    assert [j.job_id for j in settle(client, client.inspect.waiting(10))] == jobs  # no group yet
    first, _ = take(redis_client, queue, "w1")
    second, _ = take(redis_client, queue, "w2")
    redis_client.hset(KEYS.job(jobs[0]), "tokens", 7)
    time.sleep(0.05)
    waiting = settle(client, client.inspect.waiting(10))
    assert [j.job_id for j in waiting] == jobs[2:]
    assert all(0 <= j.waited_s < 5 for j in waiting)
    assert [j.job_id for j in settle(client, client.inspect.waiting(1))] == jobs[2:3]
    running = settle(client, client.inspect.running(10))
    assert [(r.job_id, r.entry_id, r.worker, r.deliveries, r.tokens) for r in running] == [
        (jobs[0], first, "w1", 1, 7),
        (jobs[1], second, "w2", 1, 0),
    ]
    assert all(0.05 <= r.idle_s < 5 for r in running)


def test_waiting_and_running_list_at_most_the_default_limit_when_given_none(client, redis_client, queue):
    """dead_letters.list() and `mili jobs` list DEFAULT_LIMIT items unless told; inspect.waiting()
    and running() took no default (a TypeError)."""
    jobs = [client.submit(f"job {i}", max_tokens=4) for i in range(DEFAULT_LIMIT + 3)]
    assert [j.job_id for j in settle(client, client.inspect.waiting())] == jobs[:DEFAULT_LIMIT]
    held = [take(redis_client, queue, "w1")[0] for _ in range(DEFAULT_LIMIT + 1)]
    assert [r.entry_id for r in settle(client, client.inspect.running())] == held[:DEFAULT_LIMIT]


def test_a_queue_without_a_stream_has_nothing(client, queue):
    overview = settle(client, client.inspect.overview())
    assert (
        overview.depth,
        overview.pending,
        overview.waiting,
        overview.dead,
        overview.oldest_waiting_s,
        overview.processed,
    ) == (
        0,
        0,
        0,
        0,
        None,
        None,
    )
    assert settle(client, client.inspect.waiting(5)) == []
    assert settle(client, client.inspect.running(5)) == []


@pytest.mark.timing
def test_the_overview_counts_depth_pending_waiting_dead_and_processed_entries(client, redis_client, queue):
    poison = client.submit("poison", max_tokens=4)
    make_poison(redis_client, queue, poison)
    for i in range(3):
        client.submit(f"job {i}", max_tokens=4)
    entry, _ = take(redis_client, queue)
    time.sleep(0.2)
    overview = settle(client, client.inspect.overview())
    assert (overview.depth, overview.pending, overview.waiting, overview.dead, overview.processed) == (3, 1, 2, 1, 1)
    assert 0.2 <= overview.oldest_waiting_s < 5  # job 1's: the first no worker has read
    redis_client.xack(KEYS.queue(queue), GROUP, entry)
    redis_client.xdel(KEYS.queue(queue), entry)
    overview = settle(client, client.inspect.overview())
    assert (overview.depth, overview.pending, overview.processed) == (2, 0, 2)


def place(redis_client, queue: str, worker: str, job_id: str, **route: str) -> str:
    """An entry on `worker`'s own stream, with the fields a placing producer writes (its lane and
    tenant ride in them), the worker named in the queue's index, as its heartbeat names it."""
    redis_client.zadd(KEYS.workers(queue), {worker: time.time()})
    return redis_client.xadd(
        KEYS.own_queue(queue, worker), {"id": job_id, "v": str(PROTOCOL_VERSION), "body": "{}", **route}
    )


@pytest.mark.timing
def test_every_view_counts_the_jobs_of_every_lanes_and_every_workers_stream(client, redis_client, queue):
    plain = client.submit("plain", max_tokens=4)
    time.sleep(0.01)
    flex = settle(client, client.as_tenant("ta").submit("flex", max_tokens=4, service_tier="flex"))
    time.sleep(0.01)
    place(redis_client, queue, "w1", "placed-1", cost="9", lane="priority", tenant="tb")
    time.sleep(0.01)
    place(redis_client, queue, "w2", "placed-2", cost="9")
    redis_client.xgroup_create(KEYS.own_queue(queue, "w2"), GROUP, id="0")
    redis_client.xreadgroup(GROUP, "w2", {KEYS.own_queue(queue, "w2"): ">"}, count=1)  # w2 runs it
    stats = settle(client, client.queue_stats())
    assert (stats.depth, stats.pending, stats.waiting) == (4, 1, 3)
    assert [(s.lane, s.tenant, s.worker, s.depth, s.pending, s.waiting) for s in stats.streams] == [
        ("default", None, None, 1, 0, 1),
        ("flex", "ta", None, 1, 0, 1),
        (None, None, "w1", 1, 0, 1),
        (None, None, "w2", 1, 1, 0),
    ]
    overview = settle(client, client.inspect.overview())
    assert (overview.depth, overview.pending, overview.waiting, overview.processed) == (4, 1, 3, 0)
    waiting = settle(client, client.inspect.waiting(10))
    assert [(j.job_id, j.lane, j.tenant, j.worker) for j in waiting] == [
        (plain, "default", None, None),
        (flex, "flex", "ta", None),
        ("placed-1", "priority", "tb", "w1"),
    ]
    assert overview.oldest_waiting_s == pytest.approx(waiting[0].waited_s, abs=0.5)
    assert [j.job_id for j in settle(client, client.inspect.waiting(2))] == [plain, flex]
    running = settle(client, client.inspect.running(10))
    assert [(r.job_id, r.worker, r.lane, r.tenant, r.placed_on) for r in running] == [
        ("placed-2", "w2", "default", None, "w2")
    ]


def test_a_lane_jobs_and_a_placed_jobs_entry_is_found_waiting_and_running(client, redis_client, queue):
    job_id = settle(client, client.as_tenant("ta").submit("flex", max_tokens=4, service_tier="flex"))
    lane_stream = KEYS.lane_stream(queue, "flex", "ta")
    status = settle(client, client.status(job_id))
    found = settle(client, client.inspect.entry_of(status, [queue]))
    assert (found.place, found.fields["id"]) == ("waiting", job_id)
    redis_client.xgroup_create(lane_stream, GROUP, id="0")
    [(_, [(entry_id, _)])] = redis_client.xreadgroup(GROUP, "w1", {lane_stream: ">"}, count=1)
    redis_client.hset(KEYS.job(job_id), mapping={"status": "running", "entry": f"{entry_id}#flex:ta"})  # as CLAIM
    found = settle(client, client.inspect.entry_of(settle(client, client.status(job_id)), [queue]))
    assert (found.place, found.entry_id, found.fields["id"]) == ("running", entry_id, job_id)
    placed_id = place(redis_client, queue, "w1", "placed-1")
    redis_client.hset(KEYS.job("placed-1"), mapping={"status": "running", "entry": f"{placed_id}@w1"})
    found = settle(client, client.inspect.entry_of(status.model_copy(update={"id": "placed-1"}), [queue]))
    assert (found.place, found.entry_id, found.fields["id"]) == ("running", placed_id, "placed-1")


@on_modes("server", "cluster")
def test_the_stats_and_listings_read_workers_streams_on_every_shard(redis_deployment, deployment_client, queue):
    """On a cluster each worker's stream has a hash tag, and so a shard, of its own."""
    workers = [f"w{i}" for i in range(4)]
    for name in workers:
        place(deployment_client, queue, name, f"placed-{name}")
    with Client(redis_deployment.url, queue) as client:
        job_id = client.as_tenant("ta").submit("flex", max_tokens=4, service_tier="flex")
        stats = client.queue_stats()
        waiting = client.inspect.waiting(10)
    assert (stats.depth, stats.waiting) == (5, 5)
    assert [s.worker for s in stats.streams] == [None, *workers]
    assert {j.job_id for j in waiting} == {job_id, *(f"placed-{name}" for name in workers)}


def heartbeat(redis_client, queue: str, name: str, ttl_s: float) -> None:
    """One heartbeat of a worker named `name`, sent by the worker's own code."""
    fields = {
        "name": name,
        "queue": queue,
        "model": "echo",
        "device": "cpu",
        "state": "serving",
        "running": 1,
        "free_slots": 3,
        "free_pages": 10,
        "total_pages": 16,
        "page_size": 16,
        "started_at": time.time(),
    }
    WorkerQueue(redis_client, KEYS, queue, name).members.heartbeat(fields, ttl_s, [])


@pytest.mark.timing
def test_a_heartbeat_turns_stale_past_half_its_ttl_and_gone_past_it(redis_server, redis_client, queue):
    # The sync and the async client read the same heartbeats at each moment: one run of the TTLs
    # for both, where a run for each cost the timing lane (nothing runs beside it) 6 s more.
    clients = {kind: make_client(kind, redis_server.url, queue) for kind in ("sync", "async")}
    ttl_s = 1.2  # stale from 0.6 s, gone from 1.2 s: each reading is 0.3 s from the next condition
    heartbeat(redis_client, queue, f"{queue}-steady", ttl_s)
    heartbeat(redis_client, queue, f"{queue}-silent", ttl_s)
    conditions = {kind: {} for kind in clients}
    started = time.monotonic()
    try:
        for at in (0.1, 0.9, 1.8, 3.6):  # inside half the TTL, past it, then past the TTL once and three times over
            time.sleep(max(0.0, started + at - time.monotonic()))
            heartbeat(redis_client, queue, f"{queue}-steady", ttl_s)
            for kind, client in clients.items():
                rows = {w.name: w for w in settle(client, client.inspect.workers()) if w.queue == queue}
                conditions[kind][at] = (rows[f"{queue}-steady"].condition, rows[f"{queue}-silent"].condition)
                silent = rows[f"{queue}-silent"]
                assert at - 0.1 <= silent.heartbeat_age_s < at + 0.5, kind
        expected = {
            0.1: ("live", "live"),
            0.9: ("live", "stale"),
            1.8: ("live", "gone"),
            3.6: ("live", "gone"),
        }
        assert conditions == {"sync": expected, "async": expected}
        for client in clients.values():
            (steady,) = [w for w in settle(client, client.inspect.workers()) if w.name == f"{queue}-steady"]
            assert (steady.info.model, steady.info.running, steady.info.free_pages, steady.info.total_pages) == (
                "echo",
                1,
                10,
                16,
            )
    finally:
        for client in clients.values():
            client.close()


def test_only_the_most_recently_gone_workers_are_listed(client, redis_client, queue):
    for i in range(12):
        redis_client.zadd(KEYS.workers(queue), {f"{queue}-gone-{i}": time.time() - 100 + i})
    redis_client.zadd(KEYS.queues(), {queue: time.time()})
    gone = [w.name for w in settle(client, client.inspect.workers()) if w.queue == queue]
    assert gone == [f"{queue}-gone-{i}" for i in range(11, 1, -1)]


@pytest.mark.parametrize("limit", [0, -1, 10_001, 2.5, True, "3"])
def test_a_listing_needs_a_limit_from_1_to_10000(client, limit):
    for listing in (client.inspect.waiting, client.inspect.running):
        with pytest.raises(InvalidArgument) as e:
            listing(limit)
        assert e.value.field == "limit"


@pytest.mark.parametrize("index", ["queue index", "worker index", "heartbeat"])
def test_a_registry_key_of_another_type_reads_as_missing_to_submits_and_listings(index, capsys):
    """The queue index, a queue's worker index or a worker's heartbeat hash of another type (an
    operator's SET: the worker's next heartbeat makes it anew) is no WRONGTYPE to a producer: its
    submits go on (placement's view, the adapters' check read no worker there), and queue_stats(),
    workers(), the inspector and `mili workers` read the key as a missing one. A private server:
    the queue index is every queue's."""
    queue, keys = "registry", Keys()
    with EmbeddedRedis(port=free_port()) as server, Client(server.url, queue) as client:
        admin = client.redis
        admin.zadd(keys.workers(queue), {"w-gone": time.time()})
        admin.zadd(keys.queues(), {queue: time.time()})
        key = {"queue index": keys.queues(), "worker index": keys.workers(queue), "heartbeat": keys.worker("w-gone")}
        admin.delete(key[index])
        admin.set(key[index], "an operator's mistake")
        job = client.submit(prompt="still enqueued", max_tokens=4)
        assert client.status(job).status == "queued"
        # queue_stats() told a live worker by its heartbeat's EXISTS: one of another type counted,
        # which for a gone worker (no heartbeat makes it anew, no TTL ends it) was for ever.
        assert (client.queue_stats().depth, client.queue_stats().workers) == (1, [])
        assert client.workers() == []
        assert [w.name for w in client.inspect.workers() if w.condition == "live"] == []
        assert mili(["--redis", server.url, "workers"]) == 0
        assert mili(["--redis", server.url, "stats", "--all"]) == 0
        assert "WRONGTYPE" not in capsys.readouterr().err


def test_stats_all_counts_the_named_queue_though_no_worker_ever_served_it(capsys):
    """`mili stats --all` read the queue index alone, which a queue enters by a worker's heartbeat:
    on a fresh Redis whose jobs wait for a first worker (the outage an operator looks into) it
    printed [], where `mili stats` counted them. The queue --queue names (default: default) is
    counted too, as the gateway counts the queues it routes to."""
    with EmbeddedRedis(port=free_port()) as server, Client(server.url, "cold") as client:
        client.submit(prompt="waits for a worker", max_tokens=4)
        client.redis.zadd(Keys().queues(), {"indexed": time.time()})
        capsys.readouterr()
        assert mili(["--redis", server.url, "--queue", "cold", "stats", "--all"]) == 0
        stats = {s["queue"]: s for s in json.loads(capsys.readouterr().out)}
        assert (stats["cold"]["depth"], stats["cold"]["waiting"], stats["indexed"]["depth"]) == (1, 1, 0)
        assert mili(["--redis", server.url, "stats", "--all"]) == 0
        assert sorted(s["queue"] for s in json.loads(capsys.readouterr().out)) == ["default", "indexed"]
