"""A queue spread over several shards (docs/architecture.md, "A queue over several shards"), on a
real redis-server with echo workers in this process: one shard is today's keys and nothing else;
with three, jobs spread over the shards by their ids, several workers serve each exactly once, a
killed worker's jobs are reclaimed in their shards, stats and dead letters cover every shard, a
producer that names no count is still served, and a bad or mismatched count is refused before
anything is enqueued; a worker's "auto" stores 1 on one server and yields to a stored count; and on
the session's 3-master cluster, the shards on every master, and "auto" stores 3 and spreads over them."""

from __future__ import annotations

import uuid
from contextlib import ExitStack

import pytest
import redis

from cli.__main__ import build_parser as mili_parser
from cli.__main__ import main as mili_main
from harness.echo_workers import GatedWorker, outcome_count, serving
from harness.polling import eventually
from producer_client import BulkQueueFull, Client, JobFailed, steps
from producer_client.cluster import master_count
from producer_client.connection import connect
from producer_client.errors import InvalidArgument, InvalidShardCount, ShardCountMismatch
from producer_client.keys import GROUP, SHARDS_FIELD, Keys
from producer_client.protocol.backlog import entry_stream, reference_parts, shard_parts, shard_ref
from producer_client.protocol.shards import serving_count, shard_of
from tests.support.jobs import assert_one_final_result, job_ids
from worker.__main__ import build_parser
from worker.__main__ import main as worker_main
from worker.embedded_redis import EmbeddedRedis, free_port
from worker.loop.reads import split_rooms
from worker.settings import WorkerSettings, settings_from_args

pytestmark = pytest.mark.waits

KEYS = Keys()
FAST_RECLAIM = dict(claim_idle_ms=500, reclaim_interval_s=0.05)
SHARDS = 3


def shard_streams(queue: str) -> list[str]:
    return [KEYS.queue(KEYS.shard(queue, i)) for i in range(SHARDS)]


def ids_by_shard(job_ids: list[str]) -> dict[int, list[str]]:
    by_shard: dict[int, list[str]] = {}
    for job_id in job_ids:
        by_shard.setdefault(shard_of(job_id, SHARDS), []).append(job_id)
    return by_shard


# -- names ---------------------------------------------------------------------------------------


def test_shard_zero_is_the_queues_own_keys_and_the_others_tags_no_name_can_have():
    assert KEYS.shard("q", 0) == "q"
    assert [KEYS.queue(KEYS.shard("q", i)) for i in range(3)] == ["mili:q:{q}", "mili:q:{q#1}", "mili:q:{q#2}"]
    assert KEYS.dead(KEYS.shard("q", 2)) == "mili:dead:{q#2}"
    with pytest.raises(InvalidArgument):
        Client("redis://localhost:1", "q#1")


@pytest.mark.parametrize(
    ("ref", "shard", "stream", "entry_id", "mark", "rest"),
    [
        ("1-0", 0, "mili:q:{q}", "1-0", "", ""),
        ("1-0%2", 2, "mili:q:{q#2}", "1-0", "", ""),
        ("1-0%12#flex:team-a", 12, "mili:q:{q#12}:flex:team-a", "1-0", "#", "flex:team-a"),
        ("1-0@w1", 0, "mili:q:{q|w1}", "1-0", "@", "w1"),
    ],
)
def test_an_entry_reference_names_its_shard_and_its_stream_within_it(ref, shard, stream, entry_id, mark, rest):
    assert shard_parts(ref)[0] == shard
    assert entry_stream(KEYS, "q", ref) == (stream, entry_id)
    assert reference_parts(ref) == (entry_id, mark, rest)
    assert shard_ref(shard_parts(ref)[1], shard) == ref


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
@pytest.mark.parametrize("rooms", [(0, 0, 0), (1, 1, 0), (7, 4, 1), (9, 9, 9), (2, 1, 1)])
def test_rooms_shared_over_shards_sum_to_the_rooms_and_still_shrink_by_lane(rooms, parts):
    shares = split_rooms(rooms, parts)
    assert tuple(sum(share[i] for share in shares) for i in range(3)) == rooms
    assert all(share[0] >= share[1] >= share[2] >= 0 for share in shares)


# -- one shard: today's protocol -------------------------------------------------------------------


@pytest.mark.parametrize(("asked", "stored"), [(None, None), ("auto", "1")])
def test_one_shard_uses_exactly_todays_keys(redis_server, redis_client, queue, asked, stored):
    """Also with a worker's "auto" on one server: one master, so the count 1, stored."""
    tenant = f"t{uuid.uuid4().hex[:6]}"
    worker = serving(redis_server.url, queue, name=f"w-{queue}", queue_shards=asked)
    with Client(redis_server.url, queue) as client, worker as w:
        assert w.queue.shards.names == [queue]
        ids = [client.submit("plain", max_tokens=2), client.as_tenant(tenant).submit("lane", service_tier="flex")]
        assert [client.result(job_id, timeout=10).status for job_id in ids] == ["done", "done"]
    # The lane's sorted set went when its one tenant's stream was read to the end.
    tagged = sorted(k for k in redis_client.keys(f"*{queue}*") if not k.startswith("mili:job:"))
    assert tagged == [
        f"mili:bell:{{{queue}}}",
        f"mili:q:{{{queue}|w-{queue}}}",
        f"mili:q:{{{queue}}}",
        f"mili:q:{{{queue}}}:flex:{tenant}",
        f"mili:sched:{{{queue}}}",
        f"mili:streams:{{{queue}}}",
        f"mili:workers:{{{queue}}}",
    ]
    assert redis_client.hget(KEYS.scheduler(queue), SHARDS_FIELD) == stored


def test_a_stored_count_wins_over_a_workers_auto(redis_server, redis_client, queue):
    with Client(redis_server.url, queue, queue_shards=SHARDS) as client:
        # Random ids: 48 leave a shard empty once in 10**8 runs (12 did once in 40).
        ids = [client.submit(f"job {i}", max_tokens=5) for i in range(48)]
        assert len(ids_by_shard(ids)) == SHARDS
        with serving(redis_server.url, queue, queue_shards="auto") as worker:
            assert worker.queue.shards.names == [KEYS.shard(queue, i) for i in range(SHARDS)]
            assert [client.result(job_id, timeout=10).text for job_id in ids] == [f"job {i}"[:5] for i in range(48)]
    assert redis_client.hget(KEYS.scheduler(queue), SHARDS_FIELD) == str(SHARDS)


def test_the_count_of_masters_is_one_but_on_a_cluster(redis_server, redis_cluster):
    with connect(redis_server.url) as one, connect("redis+sentinel://127.0.0.1:1/mymaster") as sentinel:
        assert (master_count(one), master_count(sentinel)) == (1, 1)  # neither asks Redis
    cluster = connect(redis_cluster.url)
    assert master_count(cluster) == 3
    cluster.close()


# -- counts that do not agree ----------------------------------------------------------------------


@pytest.mark.parametrize("count", [0, -1, 65, True, 2.0, "3", "automatic", "0", "", None])
def test_a_bad_shard_count_is_refused_by_the_client_and_the_worker(count):
    with pytest.raises(InvalidArgument) as e:
        Client("redis://localhost:1", "q", queue_shards=count)
    assert e.value.field == "queue_shards"
    if count not in ("3", None):  # the worker's settings read a flag's text "3" as 3; None is unset
        with pytest.raises(InvalidArgument, match="^queue_shards: must be an integer from 1 to 64, or 'auto'$"):
            WorkerSettings(queue_shards=count)


@pytest.mark.parametrize("flag", ["automatic", "0", "65", "3.0"])
def test_a_bad_shard_count_flag_stops_the_worker_before_it_reaches_redis(flag, capsys):
    # Port 1: a worker that got as far as Redis would wait for it, with backoff.
    assert worker_main(["serve", "--redis", "redis://127.0.0.1:1", "--queue-shards", flag]) == 2
    assert (
        capsys.readouterr().err == "error: invalid_argument: queue_shards: must be an integer from 1 to 64, or 'auto'\n"
    )


def test_mili_takes_the_workers_auto_and_refuses_a_bad_count_with_invalid_argument(
    redis_server, queue, monkeypatch, capsys
):
    # MILI_QUEUE_SHARDS is the worker's variable too: "auto" there must not break `mili` beside it.
    monkeypatch.setenv("MILI_QUEUE_SHARDS", "auto")
    assert mili_main(["--redis", redis_server.url, "--queue", queue, "stats"]) == 0
    assert mili_parser().parse_args(["--queue-shards", "3", "stats"]).queue_shards == 3
    capsys.readouterr()
    assert mili_main(["--redis", redis_server.url, "--queue", queue, "--queue-shards", "automatic", "stats"]) == 1
    assert (
        capsys.readouterr().err == "error: invalid_argument: queue_shards: must be an integer from 1 to 64, or 'auto'\n"
    )


def test_a_shard_count_flag_takes_a_number_or_auto():
    parser = build_parser()
    for flag, count in [("3", 3), ("auto", "auto")]:
        args = parser.parse_args(["serve", "--queue-shards", flag])
        assert settings_from_args(args).queue_shards == count
    assert settings_from_args(parser.parse_args(["serve"])).queue_shards is None


def test_a_count_other_than_the_queues_is_refused_before_anything_is_enqueued(redis_server, redis_client, queue):
    with Client(redis_server.url, queue, queue_shards=SHARDS) as first:
        first.submit("stores the count", max_tokens=1)
    jobs_before = job_ids(redis_client)
    with Client(redis_server.url, queue, queue_shards=2) as other:
        for submit in (
            lambda: other.submit("x", request_id=f"r-{queue}"),
            lambda: other.submit_many([{"prompt": "y"}, {"prompt": "z", "request_id": f"s-{queue}"}]),
        ):
            with pytest.raises(ShardCountMismatch) as e:
                submit()
            assert (e.value.asked, e.value.stored) == (2, SHARDS)
    assert job_ids(redis_client) <= jobs_before
    assert sum(redis_client.xlen(s) for s in shard_streams(queue)) == 1
    with pytest.raises(ShardCountMismatch):
        with serving(redis_server.url, queue, queue_shards=2):
            pass


@pytest.mark.parametrize("stored", ["x", "0", "-2", "65", "3.0", ""])
def test_a_stored_count_that_is_no_count_is_a_typed_error_for_every_reader(redis_server, redis_client, queue, stored):
    # Producers may write the queue's scheduler hash, so its `shards` field may hold anything.
    redis_client.hset(Keys().scheduler(queue), SHARDS_FIELD, stored)
    jobs_before = job_ids(redis_client)
    with Client(redis_server.url, queue, queue_shards=SHARDS) as client:
        with pytest.raises(InvalidShardCount) as e:
            client.submit("x", max_tokens=1)
        assert (e.value.queue, e.value.stored, e.value.code) == (queue, stored, "invalid_shard_count")
        with pytest.raises(InvalidShardCount):
            client.queue_stats()
    with Client(redis_server.url, queue, queue_shards="auto") as auto:
        with pytest.raises(InvalidShardCount):
            auto.submit("y", max_tokens=1)
    assert job_ids(redis_client) <= jobs_before
    with pytest.raises(InvalidShardCount):
        with serving(redis_server.url, queue):
            pass


# -- three shards on one server ---------------------------------------------------------------------


def test_a_full_shard_names_every_job_in_the_queue_a_request_id_found_past_the_refused_one_too(
    redis_server, redis_client, queue
):
    """Three shards of two entries each. A job of shard `x` is in already (request_id `old`). A
    submit_many of two fresh request ids of `x`, `old` again and one of shard `y`: `x`'s chunk goes
    first; its first job fits, the second is refused. On main BulkQueueFull's job_ids left `old`
    out, in the queue past the refused job (its chunk's ids were cut at the first refused), where
    the ids on several shards are every spec in the queue; `y`'s chunk is never sent."""
    tag = uuid.uuid4().hex[:8]
    by_shard: dict[int, list[str]] = {}
    for i in range(200):
        by_shard.setdefault(shard_of(f"{tag}-{i}", SHARDS), []).append(f"{tag}-{i}")
    (old, x1, x2), (y1,) = by_shard[0][:3], by_shard[1][:1]
    with Client(redis_server.url, queue, queue_shards=SHARDS, max_queue_depth=2) as client:
        client.submit(old, max_tokens=1, request_id=old)
        specs = [{"prompt": job_id, "max_tokens": 1, "request_id": job_id} for job_id in (x1, x2, old, y1)]
        with pytest.raises(BulkQueueFull) as full:
            client.submit_many(specs)
    assert full.value.job_ids == [x1, old]
    assert [fields["id"] for _, fields in redis_client.xrange(shard_streams(queue)[0])] == [old, x1]
    assert [bool(redis_client.exists(KEYS.job(job_id))) for job_id in (x1, x2, old, y1)] == [True, False, True, False]


def test_jobs_spread_over_the_shards_and_several_workers_serve_each_once(redis_server, redis_client, queue):
    with Client(redis_server.url, queue, queue_shards=SHARDS) as client:
        ids = [client.submit(f"one {i} " * 4, max_tokens=16) for i in range(12)]
        ids += client.submit_many([{"prompt": f"many {i} " * 4, "max_tokens": 16} for i in range(24)])
        # Before any worker: each job waits in its id's shard, and the stats count them all.
        for shard, job_ids in ids_by_shard(ids).items():
            waiting = [fields["id"] for _, fields in redis_client.xrange(shard_streams(queue)[shard])]
            assert sorted(waiting) == sorted(job_ids)
        assert len(ids_by_shard(ids)) == SHARDS
        stats = client.queue_stats()
        assert (stats.depth, stats.waiting) == (36, 36)
        assert {s.shard: s.waiting for s in stats.streams} == {k: len(v) for k, v in ids_by_shard(ids).items()}
        assert client.inspect.overview().depth == 36
        with ExitStack() as stack:
            # Four jobs at a time each, so that neither takes them all; the second worker names no
            # count: it reads the queue's.
            slow = dict(step_s=0.01, engine={"max_running": 4})
            workers = [
                stack.enter_context(serving(redis_server.url, queue, name=f"a-{queue}", queue_shards=SHARDS, **slow)),
                stack.enter_context(serving(redis_server.url, queue, name=f"b-{queue}", **slow)),
            ]
            results = [client.result(job_id, timeout=20) for job_id in ids]
    assert [r.status for r in results] == ["done"] * len(ids)
    assert {r.worker for r in results} == {w.name for w in workers}
    for job_id in ids:
        assert_one_final_result(redis_client, job_id)
    assert sum(redis_client.xlen(s) for s in shard_streams(queue)) == 0


def test_a_producer_that_names_no_count_writes_shard_zero_and_is_served(redis_server, redis_client, queue):
    with (
        Client(redis_server.url, queue, queue_shards=SHARDS) as sharded,
        Client(redis_server.url, queue) as stale,
        serving(redis_server.url, queue, queue_shards=SHARDS),
    ):
        sharded.submit("stores the count", max_tokens=1)
        ids = [stale.submit(f"old {i}", max_tokens=3) for i in range(6)]
        assert [stale.result(job_id, timeout=10).text for job_id in ids] == [f"old {i}"[:3] for i in range(6)]


def test_lane_jobs_of_a_killed_worker_are_reclaimed_within_their_shards(redis_server, redis_client, queue):
    tenant = f"t{uuid.uuid4().hex[:6]}"
    settings = dict(queue_shards=SHARDS, **FAST_RECLAIM)
    with ExitStack() as stack:
        client = stack.enter_context(Client(redis_server.url, queue, tenant=tenant, queue_shards=SHARDS))
        victim = stack.enter_context(
            serving(redis_server.url, queue, step_s=0.01, worker_class=GatedWorker, name=f"v-{queue}", **settings)
        )
        tiers = ["flex", "priority", "default"] * 3
        ids = [client.submit(f"job {i} " * 10, max_tokens=60, service_tier=tier) for i, tier in enumerate(tiers)]
        assert eventually(lambda: len(victim.holdings.running) == len(ids))
        held = {shard_parts(ref)[0] for ref in victim.holdings.entries()}
        assert held == set(ids_by_shard(ids)) and len(held) > 1
        victim.killed = True
        victim.gate.clear()
        survivor = stack.enter_context(serving(redis_server.url, queue, step_s=0.002, name=f"s-{queue}", **settings))
        results = [client.result(job_id, timeout=20) for job_id in ids]
        victim.gate.set()
    assert all(r.status == "done" and r.worker == survivor.name for r in results)
    assert [r.text for r in results] == [(f"job {i} " * 10)[:60] for i in range(len(ids))]
    for shard in range(SHARDS):
        for lane in ("priority", "default", "flex"):
            stream = KEYS.lane_stream(KEYS.shard(queue, shard), lane, tenant)
            assert redis_client.xlen(stream) == 0
            if redis_client.exists(stream):
                assert redis_client.xpending(stream, GROUP)["pending"] == 0


def test_dead_letters_are_written_listed_and_retried_in_their_shards(redis_server, redis_client, queue):
    with Client(redis_server.url, queue, queue_shards=SHARDS) as client:
        ids = [client.submit(f"poison {i}", max_tokens=2) for i in range(6)]
        shards = {job_id: shard_of(job_id, SHARDS) for job_id in ids}
        for stream in shard_streams(queue):  # a ghost worker took each entry, and died three times over
            redis_client.xgroup_create(stream, GROUP, id="0", mkstream=True)
            taken = redis_client.xreadgroup(GROUP, "ghost", {stream: ">"}) or []
            for _, entries in taken:
                redis_client.xclaim(stream, GROUP, "ghost", 0, [e for e, _ in entries], retrycount=3)
        with serving(redis_server.url, queue, max_deliveries=3, **FAST_RECLAIM) as worker:
            for job_id in ids:
                with pytest.raises(JobFailed):
                    client.result(job_id, timeout=10)
            assert eventually(lambda: outcome_count(worker, "dead_lettered") == len(ids))
        for job_id in ids:
            (letter,) = [
                fields
                for _, fields in redis_client.xrange(KEYS.dead(KEYS.shard(queue, shards[job_id])))
                if fields["id"] == job_id
            ]
        letters = client.dead_letters.list(100)
        assert {(letter.job_id, letter.shard) for letter in letters} == set(shards.items())
        assert client.inspect.overview().dead == len(ids)
        assert client.dead_letters.get(ids[-1]).shard == shards[ids[-1]]
        with serving(redis_server.url, queue):
            outcomes = client.dead_letters.retry_all()
            assert sorted(o.job_id for o in outcomes if o.outcome == "retried") == sorted(ids)
            assert [client.result(job_id, timeout=10).status for job_id in ids] == ["done"] * len(ids)
        assert client.dead_letters.list(100) == []
        assert client.dead_letters.purge_all() == 0


# -- three shards on a 3-master cluster -------------------------------------------------------------


def spread_queue(client: Client) -> str:
    """A fresh queue name whose three shards' tags lie on three different masters."""
    while True:
        name = f"q-{uuid.uuid4().hex[:8]}"
        if len({client.redis.get_node_from_key(stream).name for stream in shard_streams(name)}) == SHARDS:
            return name


def test_on_a_cluster_the_shards_lie_on_every_master_and_each_job_is_served_once(redis_cluster):
    """Jobs spread over three masters; a worker killed while it holds jobs of every shard has them
    reclaimed, each in its shard, by the one left."""
    with Client(redis_cluster.url, "probe") as probe:
        queue = spread_queue(probe)
    admin = connect(redis_cluster.url, decode_responses=True)
    settings = dict(queue_shards=SHARDS, **FAST_RECLAIM)
    with Client(redis_cluster.url, queue, queue_shards=SHARDS) as client, ExitStack() as stack:
        # Random ids: 36 leave a shard empty once in 10**6 runs (18 did once in 500).
        ids = [client.submit(f"one {i} " * 8, max_tokens=40) for i in range(6)]
        ids += client.submit_many([{"prompt": f"many {i} " * 8, "max_tokens": 40} for i in range(30)])
        for shard, job_ids in ids_by_shard(ids).items():
            assert sorted(f["id"] for _, f in admin.xrange(shard_streams(queue)[shard])) == sorted(job_ids)
        assert client.queue_stats().waiting == len(ids)
        victim = stack.enter_context(
            serving(redis_cluster.url, queue, step_s=0.01, worker_class=GatedWorker, name=f"v-{queue}", **settings)
        )
        assert eventually(lambda: len(victim.holdings.running) == len(ids))
        assert {shard_parts(ref)[0] for ref in victim.holdings.entries()} == set(range(SHARDS))
        victim.killed = True
        victim.gate.clear()
        survivor = stack.enter_context(serving(redis_cluster.url, queue, step_s=0.002, name=f"s-{queue}", **settings))
        results = [client.result(job_id, timeout=30) for job_id in ids]
        victim.gate.set()
        texts = [(f"one {i} " * 8)[:40] for i in range(6)] + [(f"many {i} " * 8)[:40] for i in range(30)]
        assert [(r.text, r.worker) for r in results] == [(text, survivor.name) for text in texts]
        for job_id in ids:
            assert_one_final_result(admin, job_id)
        assert client.queue_stats().depth == 0
    admin.close()


def test_on_a_cluster_a_workers_auto_stores_its_masters_and_auto_producers_spread_over_them(redis_cluster):
    with Client(redis_cluster.url, "probe") as probe:
        queue = spread_queue(probe)
    admin = connect(redis_cluster.url, decode_responses=True)
    with serving(redis_cluster.url, queue, queue_shards="auto") as first:
        assert len(first.queue.shards.names) == SHARDS
    assert admin.hget(KEYS.scheduler(queue), SHARDS_FIELD) == str(SHARDS)
    with Client(redis_cluster.url, queue, queue_shards="auto") as client:
        ids = client.submit_many([{"prompt": f"many {i}", "max_tokens": 8} for i in range(45)])
        ids += [client.submit(f"one {i}", max_tokens=8) for i in range(3)]
        # Before a worker serves them: each waits in its id's shard, and 48 ids leave none empty.
        for shard, job_ids in ids_by_shard(ids).items():
            assert sorted(f["id"] for _, f in admin.xrange(shard_streams(queue)[shard])) == sorted(job_ids)
        assert len(ids_by_shard(ids)) == SHARDS
        with serving(redis_cluster.url, queue, queue_shards="auto", name=f"s-{queue}") as worker:
            results = [client.result(job_id, timeout=30) for job_id in ids]
    texts = [f"many {i}"[:8] for i in range(45)] + [f"one {i}"[:8] for i in range(3)]
    assert [(r.text, r.worker) for r in results] == [(text, worker.name) for text in texts]
    for job_id in ids:
        assert_one_final_result(admin, job_id)
    admin.close()


def test_an_auto_producer_spreads_over_each_queues_own_count(redis_server, redis_client, queue):
    other = f"{queue}-one"
    with Client(redis_server.url, queue, queue_shards=SHARDS) as first:
        first.submit("stores the count", max_tokens=1)
    with Client(redis_server.url, queue, queue_shards="auto") as auto:
        ids = auto.submit_many([{"prompt": f"{i}"} for i in range(12)]) + [auto.submit("one more")]
        for shard, job_ids in ids_by_shard(ids).items():
            waiting = {fields["id"] for _, fields in redis_client.xrange(shard_streams(queue)[shard])}
            assert set(job_ids) <= waiting
        plain = auto.on_queue(other)
        plain_ids = [plain.submit(f"{i}") for i in range(4)]
        assert [f["id"] for _, f in redis_client.xrange(KEYS.queue(other))] == plain_ids
    assert redis_client.hget(KEYS.scheduler(other), SHARDS_FIELD) is None
    with pytest.raises(InvalidArgument, match="or 'auto'"):
        Client("redis://localhost:1", "q", queue_shards="all")


def test_a_stored_count_is_read_without_a_write_so_workers_start_while_redis_refuses_writes():
    """Over maxmemory Redis refuses every write, HSETNX too even where it would change nothing: a
    worker (or producer) naming the stored count, or "auto", still starts; on a queue with no count
    stored yet, the refusal is Redis's own error, raised (found by the fault schedules, a worker
    started in an out-of-memory window)."""
    with EmbeddedRedis(port=free_port()) as server, connect(server.url) as admin:
        admin.hset(KEYS.scheduler("stored"), SHARDS_FIELD, SHARDS)
        admin.config_set("maxmemory", 1)
        try:
            with pytest.raises(redis.OutOfMemoryError):
                admin.hsetnx(KEYS.scheduler("stored"), SHARDS_FIELD, SHARDS)
            for asked in (SHARDS, "auto", None):
                assert steps.run(admin, serving_count(KEYS, "stored", asked, 1)) == SHARDS
            with pytest.raises(redis.OutOfMemoryError):
                steps.run(admin, serving_count(KEYS, "fresh", SHARDS, 1))
        finally:
            admin.config_set("maxmemory", 0)
        assert steps.run(admin, serving_count(KEYS, "fresh", SHARDS, 1)) == SHARDS
        assert admin.hget(KEYS.scheduler("fresh"), SHARDS_FIELD) == str(SHARDS).encode()
