"""Cache-aware placement (docs/architecture.md): how a producer keys and places a job (no Redis),
then the real worker loop on a real redis-server: placed jobs run on the worker they were placed
on, entries placed on a stalled worker are stolen after steal_delay_ms, a dead worker's are
reclaimed and resumed, and either side can turn placement off."""

from __future__ import annotations

import math
import time
from contextlib import ExitStack

import pytest

from harness.echo_workers import GatedWorker, serving
from harness.polling import eventually
from producer_client import BulkQueueFull, Client, steps
from producer_client.errors import UnknownAdapter
from producer_client.keys import GROUP, Keys
from producer_client.new_job import build_job
from producer_client.operations import enqueue_commands
from producer_client.placement import (
    PREFIX_CHARS,
    Candidate,
    Placed,
    Placement,
    View,
    candidates_from,
    prefix_key,
    rendezvous_score,
    served_adapters,
)
from producer_client.protocol import execution
from producer_client.schema import JobRequest
from tests.support.fixtures import on_modes
from tests.support.jobs import assert_one_final_result, tokens_published

pytestmark = pytest.mark.waits

KEYS = Keys()
SYSTEM = {"role": "system", "content": "You are a terse assistant. " * 8}


def request(**fields) -> JobRequest:
    return JobRequest.model_validate(fields)


def chat(first: str, *later: str) -> JobRequest:
    messages = [SYSTEM, {"role": "user", "content": first}]
    for i, text in enumerate(later):
        messages += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": text}]
    return request(messages=messages)


# -- keys and choices, no Redis ---------------------------------------------------------------------


def test_every_turn_of_a_conversation_is_keyed_by_its_root():
    first = prefix_key(chat("plan a trip"))
    assert prefix_key(chat("plan a trip", "to Lyon", "by train")) == first
    assert prefix_key(chat("plan a dinner")) != first
    assert (
        prefix_key(request(messages=[{**SYSTEM, "content": "other"}, {"role": "user", "content": "plan a trip"}]))
        != first
    )


def test_a_prompt_is_keyed_by_its_start_and_token_ids_by_their_first_256():
    head = "x" * PREFIX_CHARS
    assert prefix_key(request(prompt=head + "one ending")) == prefix_key(request(prompt=head + "another"))
    assert prefix_key(request(prompt="a" + head)) != prefix_key(request(prompt="b" + head))
    assert prefix_key(request(input_ids=list(range(256)) + [1])) == prefix_key(
        request(input_ids=list(range(256)) + [2])
    )
    assert prefix_key(request(input_ids=[1, 2])) != prefix_key(request(input_ids=[1, 3]))


def test_a_job_on_a_lora_adapter_is_keyed_by_its_adapter_alone():
    sql = prefix_key(request(prompt="one", adapter="sql"))
    assert prefix_key(request(messages=chat("plan a trip").messages, adapter="sql")) == sql
    assert prefix_key(request(prompt="one", adapter="chat")) != sql
    assert prefix_key(request(prompt="one")) != sql


def test_a_hot_adapters_jobs_stay_on_its_worker_up_to_the_bound_then_spread():
    key = prefix_key(request(prompt="any", adapter="hot"))
    v = view(0, 0, 0, 0, slots=64)
    order = order_of(v, key)
    placed = [Placement()._place(v, key, KEYS, "q") for _ in range(200)]
    owners = [stream.rsplit("|", 1)[-1].rstrip("}") for stream in placed]
    assert owners[:32] == [order[0]] * 32  # least load + 32 is the bound while the others are idle
    counts = [owners.count(name) for name in order]
    # Then every worker takes a share, none above the bound: 1.25 x the mean once that is the higher.
    assert min(counts) > 0 and max(counts) <= math.ceil(1.25 * 200 / 4)


def test_the_view_says_which_adapters_the_queues_serving_workers_serve():
    beats = [
        {"queue": "q", "state": "serving", "adapters": "a,b"},
        {"queue": "q", "state": "serving"},  # serves none
        {"queue": "q", "state": "draining", "adapters": "c"},
        {"queue": "other", "state": "serving", "adapters": "d"},
        {},  # expired
    ]
    assert served_adapters(beats, "q") == {"a", "b"}
    assert served_adapters(beats[3:], "q") is None  # no live worker of the queue: nothing is known


def test_a_producer_refuses_an_adapter_no_live_worker_serves_and_lets_one_through_when_it_cannot_know():
    placement = Placement(enabled=False)  # the check reads the view whether placement is on or off
    placement.views["q"] = View(time.monotonic(), [], frozenset({"sql"}))
    steps.run(None, placement.check_adapters(KEYS, "q", ["sql", None]))  # a fresh view: no round trip
    with pytest.raises(UnknownAdapter) as e:
        steps.run(None, placement.check_adapters(KEYS, "q", ["sql", "chat"]))
    assert e.value.message == "no LoRA adapter named 'chat' is served by the live workers of queue 'q'"
    placement.views["q"] = View(time.monotonic(), [], None)
    steps.run(None, placement.check_adapters(KEYS, "q", ["chat"]))


def first_choices(names: list[str], keys: list[bytes]) -> list[str]:
    return [max(names, key=lambda n: rendezvous_score(k, n)) for k in keys]


def test_a_worker_leaving_moves_only_the_keys_it_held_and_spreads_them():
    keys = [i.to_bytes(4, "big") for i in range(2000)]
    names = [f"w{i}" for i in range(5)]
    before = first_choices(names, keys)
    after = first_choices([n for n in names if n != "w2"], keys)
    assert all(a == b for a, b in zip(after, before) if b != "w2")
    moved = [a for a, b in zip(after, before) if b == "w2"]
    assert {n: moved.count(n) for n in names if n != "w2"} == pytest.approx(
        {n: len(moved) / 4 for n in names if n != "w2"}, rel=0.3
    )
    assert all(300 <= before.count(n) <= 500 for n in names)  # 400 each on average


def view(*loads: int, slots: int = 256) -> View:
    return View(time.monotonic(), [Candidate(f"w{i}", slots, load) for i, load in enumerate(loads)])


def order_of(v: View, key: bytes) -> list[str]:
    return sorted((c.name for c in v.candidates), key=lambda n: rendezvous_score(key, n), reverse=True)


def loaded(key: bytes, *loads: int, slots: int = 256) -> View:
    """Three or two workers whose loads are given in the key's rendezvous order."""
    names = order_of(view(*loads), key)
    return View(0, [Candidate(name, slots, load) for name, load in zip(names, loads)])


def test_a_job_goes_to_its_first_choice_while_that_one_is_under_the_bound():
    key = b"conversation"
    first, second, third = order_of(view(0, 0, 0), key)
    assert view(0, 0, 0).choose(key).name == first
    # The bound is the higher of ceil(1.25 x mean load, this job included) and the least load + 32.
    assert loaded(key, 31, 0, 0).choose(key).name == first  # bound max(14, 32)
    assert loaded(key, 32, 0, 0).choose(key).name == second
    assert loaded(key, 100, 80, 80).choose(key).name == first  # bound max(109, 112)
    assert loaded(key, 120, 80, 80).choose(key).name == second  # bound max(118, 112)


def test_a_full_first_choice_gives_way_to_one_with_a_free_slot_then_to_a_backlog_of_one_batch():
    key = b"conversation"
    first, second = order_of(view(0, 0), key)
    assert loaded(key, 2, 1, slots=2).choose(key).name == second  # the first has no free slot, the second has one
    assert loaded(key, 3, 2, slots=2).choose(key).name == first  # neither has: the first is under twice its slots


def test_the_shared_stream_takes_a_job_with_one_worker_or_none_under_the_bound():
    assert view(0).choose(b"k") is None
    assert View(0, []).choose(b"k") is None
    assert view(8, 8, slots=4).choose(b"k") is None  # each at twice its slots


def test_placement_counts_what_it_placed_and_counts_it_into_the_load():
    placement = Placement()
    v = placement.views["q"] = view(0, 0, slots=2)
    streams = drive(placement.streams_for(KEYS, "q", [b"a", b"a", b"a"]))
    first, second = (KEYS.own_queue("q", name) for name in order_of(v, b"a"))
    assert streams == [first, first, second]  # the first choice's two slots are taken by the first two
    assert sum(c.load for c in v.candidates) == 3
    assert placement.placed == {Placed.AFFINITY: 3, Placed.SHARED: 0}
    off = Placement(enabled=False)
    assert drive(off.streams_for(KEYS, "q", [b"a"])) == [None] and off.placed[Placed.SHARED] == 1


def drive(steps):
    """A steps operation that needs no round trip (the view is fresh): its value."""
    with pytest.raises(StopIteration) as done:
        next(steps)
    return done.value.value


def test_only_serving_workers_of_the_queue_that_advertise_placement_are_candidates():
    beat = {
        "name": "a",
        "queue": "q",
        "state": "serving",
        "placement": "1",
        "running": "3",
        "slots": "8",
        "placed_held": "2",
    }
    beats = [
        beat,
        {**beat, "name": "b", "state": "draining"},
        {**beat, "name": "c", "queue": "other"},
        {**beat, "name": "d", "placement": "0"},
        {},
        {**beat, "name": "e", "slots": "many"},
    ]
    # a's load: 3 running, and 5 entries in its stream of which 2 are among those it holds.
    assert candidates_from(beats, [5, 0, 0, 0, 0, 0], "q") == [Candidate("a", 8, 6)]


# -- the worker loop on a real redis-server ---------------------------------------------------------

FAST = dict(claim_idle_ms=500, reclaim_interval_s=0.05, heartbeat_ttl_s=2.0, block_ms=200, placement_poll_ms=20)


def enqueue_on(client: Client, owner: str, prompt: str, **options) -> str:
    """A job placed on `owner`'s stream, as a producer's placement would place it."""
    job = build_job(prompt, None, None, None, None, 0, {"max_tokens": 8, **options})
    stream = KEYS.own_queue(client.queue, owner)
    replies = execution.execute(
        client.redis,
        enqueue_commands(KEYS, client.queue, None, job, True, client.replication, stream),
    )
    assert replies[1][0] == 1
    return job.job_id


def test_each_conversation_runs_on_its_first_choice_turn_after_turn(redis_server, queue):
    # Fixed names, so the rendezvous order of the six conversations is fixed too: with names drawn
    # at random (the queue's), all six could choose one worker, one run in 243.
    names = [f"affinity-{i}" for i in range(3)]
    conversations = [f"conversation {i}: tell me about {i * 7}" for i in range(6)]
    with ExitStack() as stack:
        workers = [stack.enter_context(serving(redis_server.url, queue, name=n, **FAST)) for n in names]
        client = stack.enter_context(Client(redis_server.url, queue))
        client.placement = Placement(refresh_s=0)  # a fresh view for every job: each sees all workers idle
        assert eventually(lambda: all(w.queue.redis.exists(KEYS.worker(w.name)) for w in workers))
        ran_on: dict[int, set[str]] = {i: set() for i in range(len(conversations))}
        for turn in range(3):
            for i, root in enumerate(conversations):
                messages = [{"role": "user", "content": root}, {"role": "assistant", "content": "ok"}] * turn
                result = client.generate(
                    messages=[*messages, {"role": "user", "content": root}], max_tokens=4, timeout=30
                )
                ran_on[i].add(result.worker)
                time.sleep(0.12)  # two heartbeats: the worker's running count is back to 0
        keys = {
            i: prefix_key(request(messages=[{"role": "user", "content": root}])) for i, root in enumerate(conversations)
        }
        assert {i: ran_on[i] for i in ran_on} == {i: {first_choices(names, [keys[i]])[0]} for i in ran_on}
        assert client.placement.placed == {Placed.AFFINITY: 18, Placed.SHARED: 0}
        assert sum(w.metrics.taken["own"]._value.get() for w in workers) == 18
        assert len({w for ws in ran_on.values() for w in ws}) >= 2


@on_modes("server", "cluster")
def test_entries_placed_on_a_stalled_worker_are_stolen_after_the_steal_delay(
    redis_deployment, deployment_client, queue
):
    url, redis_client = redis_deployment.url, deployment_client
    steal_delay_s = 0.3
    settings = dict(FAST, steal_delay_ms=int(steal_delay_s * 1000), claim_idle_ms=3000, engine={"max_running": 2})
    with ExitStack() as stack:
        stalled = stack.enter_context(serving(url, queue, name=f"{queue}-a", worker_class=GatedWorker, **settings))
        taker = stack.enter_context(serving(url, queue, name=f"{queue}-b", step_s=0.01, **settings))
        client = stack.enter_context(Client(url, queue))
        assert eventually(lambda: redis_client.exists(KEYS.worker(taker.name)))
        stalled.gate.clear()
        time.sleep(0.1)
        jobs = [enqueue_on(client, stalled.name, f"job {i} placed on a stalled worker") for i in range(8)]
        results = [client.result(job_id, timeout=30) for job_id in jobs]
        stalled.gate.set()
        assert {r.worker for r in results} == {taker.name}
        waits = sorted(r.timings.queue_s for r in results)
        assert waits[0] >= steal_delay_s  # none before its delay
        # The first two (the taker's slots) start within the delay, a scan interval (half the delay)
        # and a loop iteration; the rest wait for those slots, as they would on the shared stream.
        assert waits[1] <= 1.5 * steal_delay_s + 0.2
        assert taker.metrics.taken["stolen"]._value.get() == 8
        own = KEYS.own_queue(queue, stalled.name)
        assert eventually(lambda: redis_client.xlen(own) == 0 and redis_client.xpending(own, GROUP)["pending"] == 0)
        time.sleep(0.3)  # the stalled worker is back: it must not run them again
        for job_id in jobs:
            assert_one_final_result(redis_client, job_id)
        assert stalled.metrics.taken["own"]._value.get() == 0


@on_modes("server", "cluster")
def test_a_dead_workers_placed_jobs_are_reclaimed_and_resume_after_their_tokens(
    redis_deployment, deployment_client, queue
):
    url, redis_client = redis_deployment.url, deployment_client
    settings = dict(FAST, engine={"max_running": 4})
    prompt = "a job placed on a worker that dies while it runs it, long enough to be killed half-way"
    with ExitStack() as stack:
        victim = stack.enter_context(
            serving(
                url,
                queue,
                name=f"{queue}-a",
                worker_class=GatedWorker,
                step_s=0.02,
                checkpoint_interval_s=0.05,
                **settings,
            )
        )
        client = stack.enter_context(Client(url, queue))
        jobs = [enqueue_on(client, victim.name, f"{prompt} {i}", max_tokens=60) for i in range(3)]
        assert eventually(lambda: all(len(tokens_published(redis_client, j)) >= 5 for j in jobs))
        victim.killed = True
        victim.gate.clear()
        survivor = stack.enter_context(serving(url, queue, name=f"{queue}-b", step_s=0.005, **settings))
        results = [client.result(job_id, timeout=30) for job_id in jobs]
        assert {r.worker for r in results} == {survivor.name}
        for i, (job_id, result) in enumerate(zip(jobs, results)):
            assert result.token_ids == list(f"{prompt} {i}".encode()[:60])
            assert tokens_published(redis_client, job_id) == result.token_ids  # resumed: no token twice
            assert_one_final_result(redis_client, job_id)
        assert survivor.metrics.taken["reclaimed"]._value.get() == 3
        victim.gate.set()


@pytest.mark.parametrize("side", ["client", "worker"])
def test_placement_turned_off_on_either_side_leaves_every_job_on_the_shared_stream(redis_server, queue, side):
    worker_settings = dict(FAST, placement=side != "worker")
    with ExitStack() as stack:
        workers = [
            stack.enter_context(serving(redis_server.url, queue, name=f"{queue}-{i}", **worker_settings))
            for i in range(2)
        ]
        client = stack.enter_context(Client(redis_server.url, queue, placement=side != "client"))
        client.placement.refresh_s = 0
        assert eventually(lambda: all(w.queue.redis.exists(KEYS.worker(w.name)) for w in workers))
        time.sleep(0.1)
        for i in range(6):
            client.generate(f"job {i}", max_tokens=2, timeout=30)
        assert client.placement.placed == {Placed.AFFINITY: 0, Placed.SHARED: 6}
        assert sum(w.metrics.taken["shared"]._value.get() for w in workers) == 6


def test_submit_many_places_a_chunk_and_what_goes_in_is_still_a_prefix(redis_server, queue, redis_client):
    """Two workers of two slots each, as their heartbeats say (no worker runs: nothing is read).
    Ten jobs of one prompt: two on the first choice, two on the second (free slots), two more on
    each (a backlog of one batch), one on the shared stream, and the tenth finds the shared
    stream full (max_queue_depth 1): BulkQueueFull names the nine that went in."""
    for name in ("a", "b"):
        beat = {
            "name": name,
            "queue": queue,
            "state": "serving",
            "placement": 1,
            "slots": 2,
            "running": 0,
            "placed_held": 0,
        }
        redis_client.hset(KEYS.worker(name), mapping=beat)
        redis_client.zadd(KEYS.workers(queue), {name: time.time()})
    with Client(redis_server.url, queue, max_queue_depth=1) as client:
        with pytest.raises(BulkQueueFull) as full:
            client.submit_many(
                [{"prompt": "same prompt", "max_tokens": 1, "request_id": f"{queue}-{i}"} for i in range(10)]
            )
    ids = [f"{queue}-{i}" for i in range(10)]
    assert full.value.job_ids == ids[:9]
    on = {name: [f["id"] for _, f in redis_client.xrange(KEYS.own_queue(queue, name))] for name in ("a", "b")}
    shared = [f["id"] for _, f in redis_client.xrange(KEYS.queue(queue))]
    by_rank = sorted(
        ("a", "b"), key=lambda n: rendezvous_score(prefix_key(request(prompt="same prompt")), n), reverse=True
    )
    assert on[by_rank[0]] == [ids[0], ids[1], ids[4], ids[5]]
    assert on[by_rank[1]] == [ids[2], ids[3], ids[6], ids[7]]
    assert shared == [ids[8]]
    assert [bool(redis_client.exists(KEYS.job(job_id))) for job_id in ids] == [True] * 9 + [False]


def test_an_idle_worker_on_one_server_wakes_for_a_job_placed_on_it_at_once(redis_server, queue, redis_client):
    """Idle, the worker blocks on its own stream and the shared one in one read (one server): a job
    placed on it starts well within the block, however long that is (here 1.5 s, four jobs; the
    heartbeat, which also ends a block, every 2 s)."""
    settings = dict(FAST, block_ms=1500, placement_poll_ms=1500, heartbeat_interval_s=2.0, claim_idle_ms=5000)
    with ExitStack() as stack:
        worker = stack.enter_context(serving(redis_server.url, queue, name=f"{queue}-a", **settings))
        client = stack.enter_context(Client(redis_server.url, queue))
        assert eventually(lambda: redis_client.exists(KEYS.worker(worker.name)))
        waits = []
        for i in range(4):
            time.sleep(0.3)  # idle again: blocked in its read
            job_id = enqueue_on(client, worker.name, f"wake {i}")
            waits.append(client.result(job_id, timeout=30).timings.queue_s)
        assert max(waits) < 0.5, waits
        assert worker.metrics.taken["own"]._value.get() == 4
