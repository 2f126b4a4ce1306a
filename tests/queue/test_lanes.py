"""The sharing rules' scripts on a real redis-server (docs/architecture.md, "Sharing rules"): lanes
read in order with the anti-starvation credit, tenants within a lane by their virtual token
counters (lifted when they become active, charged at read, corrected later, weighted), the rate
limits (GCRA: never more than the limit and one full bucket), the waiting quota and the bound of
each stream, the doorbell, and reclaims across the lane streams."""

from __future__ import annotations

import time
import uuid

import pytest

from producer_client.keys import GROUP, LANES, LUA_STREAM_OF, NO_TENANT, PROTOCOL_VERSION, Keys
from producer_client.protocol import producer, worker
from producer_client.protocol.execution import execute
from producer_client.protocol.lanes import CREDIT_EVERY, DEFAULT_COST, DOORBELL_MAXLEN
from producer_client.protocol.producer import LaneJob, Limits
from producer_client.protocol.worker import WORKER_SCRIPTS
from worker.loop.queue import HANDED_OVER_IDLE_MS
from worker.loop.queue import HANDED_OVER_MIN_IDLE_MS as HANDED
from worker.loop.worker_queue import WorkerQueue

KEYS = Keys()
NO_LIMITS = Limits()


@pytest.fixture
def queue(redis_client):
    name = f"q-{uuid.uuid4().hex[:8]}"
    redis_client.xgroup_create(KEYS.queue(name), GROUP, id="0", mkstream=True)  # as a worker's start does
    return name


def call(redis_client, script_call):
    return execute(redis_client, script_call.add_to, WORKER_SCRIPTS)[0]


def enqueue(redis_client, queue, tenant, lanes, cost=100, limits=NO_LIMITS, max_depth=0, reserve=False):
    """ENQUEUE_LANES of one job per lane named in `lanes`; returns the reply."""
    jobs = [LaneJob(lane, cost, uuid.uuid4().hex, "{}") for lane in lanes]
    return call(redis_client, producer.enqueue_lanes(KEYS, queue, tenant, jobs, max_depth, limits, reserve))


def read(redis_client, queue, rooms=(1, 1, 1), corrections=None, consumer="w1"):
    """READ; returns [(lane, tenant, count)] in the order served."""
    reply = call(redis_client, worker.read(KEYS, queue, consumer, rooms, DEFAULT_COST, corrections or {}))
    return [(lane, tenant, len(entries)) for lane, tenant, entries in reply]


def served_order(redis_client, queue, reads, rooms=(1, 1, 1)):
    """The (lane, tenant) of each entry of `reads` reads, one entry each."""
    order = []
    for _ in range(reads):
        order += [(lane, tenant) for lane, tenant, n in read(redis_client, queue, rooms) for _ in range(n)]
    return order


def counter(redis_client, queue, lane, tenant):
    return redis_client.zscore(KEYS.lane(queue, lane), tenant)


def test_the_scripts_name_a_lanes_stream_as_keys_does(redis_client):
    script = LUA_STREAM_OF + "return stream_of(KEYS[1], ARGV[1], ARGV[2])"
    for lane in LANES:
        for tenant in (NO_TENANT, "team-a"):
            assert redis_client.eval(script, 1, KEYS.queue("q"), lane, tenant) == KEYS.lane_stream("q", lane, tenant)
    assert KEYS.lane_stream("q", "default", NO_TENANT) == KEYS.queue("q")


def test_a_higher_lane_is_read_first_and_each_lane_within_its_room(redis_client, queue):
    enqueue(redis_client, queue, "a", ["flex"] * 3 + ["default"] * 3 + ["priority"] * 3)
    assert read(redis_client, queue, rooms=(5, 4, 4)) == [("priority", "a", 3), ("default", "a", 1)]
    # Room for the priority lane only (a worker full of lower lanes' jobs): nothing else is read.
    assert read(redis_client, queue, rooms=(3, 0, 0)) == []
    assert read(redis_client, queue, rooms=(9, 9, 3)) == [("default", "a", 2), ("flex", "a", 1)]
    assert read(redis_client, queue, rooms=(9, 9, 0)) == []


def test_tenants_of_a_lane_get_equal_tokens_whatever_they_sent(redis_client, queue):
    enqueue(redis_client, queue, "a", ["default"] * 8)
    enqueue(redis_client, queue, "b", ["default"] * 2)
    order = [tenant for _, tenant in served_order(redis_client, queue, 10)]
    assert order == ["a", "b", "a", "b", "a", "a", "a", "a", "a", "a"]
    assert counter(redis_client, queue, "default", "a") is None  # both read to the end: left the lane
    assert redis_client.hget(KEYS.scheduler(queue), "c:default:a") == "800"


def test_a_tenants_weight_multiplies_its_share(redis_client, queue):
    enqueue(redis_client, queue, "a", ["default"] * 6)
    enqueue(redis_client, queue, "b", ["default"] * 6, limits=Limits(weight=2.0))
    order = [tenant for _, tenant in served_order(redis_client, queue, 9)]
    assert order.count("b") == 6 and order.count("a") == 3


@pytest.mark.parametrize("stored", ["1e-310", "0.0009", "1001", "-2"])
def test_a_stored_weight_outside_the_range_reads_as_the_default(redis_client, queue, stored):
    """A producer may write the scheduler hash: a weight of 1e-310 charged 100 / 1e-310, an infinite
    counter, which reads back as no number (0) wherever a tenant is lifted to it."""
    enqueue(redis_client, queue, "a", ["default"] * 4)
    enqueue(redis_client, queue, "b", ["default"] * 4)
    redis_client.hset(KEYS.scheduler(queue), "w:b", stored)
    assert [tenant for _, tenant in served_order(redis_client, queue, 4)] == ["a", "b", "a", "b"]
    assert (counter(redis_client, queue, "default", "a"), counter(redis_client, queue, "default", "b")) == (200, 200)


def test_several_entries_of_the_least_served_tenant_are_read_at_once(redis_client, queue):
    enqueue(redis_client, queue, "a", ["default"] * 10)
    assert read(redis_client, queue, rooms=(10, 10, 10)) == [("default", "a", 10)]
    enqueue(redis_client, queue, "b", ["default"])  # lifted to a's 1,000: they tie
    enqueue(redis_client, queue, "a", ["default"] * 4)
    enqueue(redis_client, queue, "c", ["default"] * 4, cost=25)
    redis_client.zadd(KEYS.lane(queue, "default"), {"c": 700})  # c is 300 tokens behind a and b
    # c first, while it stays least: one entry to learn its cost, then the other 3 of 25 tokens at once.
    assert read(redis_client, queue, rooms=(6, 6, 6)) == [
        ("default", "c", 1),
        ("default", "c", 3),
        ("default", "a", 1),
        ("default", "b", 1),
    ]


def test_a_tenant_that_becomes_active_is_lifted_to_the_least_served(redis_client, queue):
    enqueue(redis_client, queue, "a", ["default"] * 5)
    served_order(redis_client, queue, 3)  # a: 300
    enqueue(redis_client, queue, "b", ["default"])
    assert counter(redis_client, queue, "default", "b") == 300  # b banked nothing while idle
    served_order(redis_client, queue, 3)  # b, then a to its end
    assert counter(redis_client, queue, "default", "a") is None
    # The lane is empty: a tenant that comes back starts at the floor, the last counter it had.
    enqueue(redis_client, queue, "c", ["default"])
    assert counter(redis_client, queue, "default", "c") == 500


def test_corrections_set_a_counter_to_what_was_served(redis_client, queue):
    enqueue(redis_client, queue, "a", ["default"] * 3, limits=Limits(weight=4.0))
    read(redis_client, queue)  # charged 100 / 4
    assert counter(redis_client, queue, "default", "a") == 25
    read(redis_client, queue, corrections={("default", "a"): 60})  # served 160 tokens, was charged 100
    assert counter(redis_client, queue, "default", "a") == 25 + 15 + 25
    read(redis_client, queue, rooms=(5, 5, 5), corrections={("default", "a"): -100})  # a job cancelled before it ran
    saved = float(redis_client.hget(KEYS.scheduler(queue), "c:default:a"))
    assert saved == 25 + 15 + 25 + 25 - 25
    read(redis_client, queue, corrections={("default", "a"): 40})  # a has left the lane: its saved counter
    assert float(redis_client.hget(KEYS.scheduler(queue), "c:default:a")) == saved + 10


def test_a_lower_lane_gets_one_entry_in_every_credit_period_under_contention(redis_client, queue):
    enqueue(redis_client, queue, "a", ["priority"] * 60)
    enqueue(redis_client, queue, "b", ["flex"] * 10)
    lanes = [lane for lane, _ in served_order(redis_client, queue, 5 * (CREDIT_EVERY + 1))]
    assert lanes == (["priority"] * CREDIT_EVERY + ["flex"]) * 5


def test_one_large_read_still_gives_a_lower_lane_one_entry_in_every_credit_period(redis_client, queue):
    enqueue(redis_client, queue, "a", ["priority"] * 60)
    enqueue(redis_client, queue, "b", ["flex"] * 10)
    rooms = (5 * (CREDIT_EVERY + 1),) * 3
    assert read(redis_client, queue, rooms=rooms) == [("priority", "a", CREDIT_EVERY), ("flex", "b", 1)] * 5


def test_the_credit_is_not_spent_while_no_higher_lane_waits(redis_client, queue):
    enqueue(redis_client, queue, "a", ["priority"] * CREDIT_EVERY)
    enqueue(redis_client, queue, "b", ["flex"] * 3)
    assert [lane for lane, _ in served_order(redis_client, queue, CREDIT_EVERY)] == ["priority"] * CREDIT_EVERY
    assert redis_client.hget(KEYS.scheduler(queue), "credit:flex") == str(CREDIT_EVERY)
    # Only flex is left: read in order, and its credit stays for when a higher lane waits again.
    assert read(redis_client, queue) == [("flex", "b", 1)]
    assert redis_client.hget(KEYS.scheduler(queue), "credit:flex") == str(CREDIT_EVERY)


def test_jobs_written_to_the_queue_stream_by_anyone_are_read_in_the_default_lane(redis_client, queue):
    for i in range(3):
        redis_client.xadd(KEYS.queue(queue), {"id": f"raw{i}", "v": PROTOCOL_VERSION, "body": "{}"})
    enqueue(redis_client, queue, "a", ["default"] * 2)
    order = served_order(redis_client, queue, 5)
    assert sorted(order) == [("default", "-")] * 3 + [("default", "a")] * 2
    assert order[:2] == [("default", "-"), ("default", "a")]  # the queue stream's tenant, lifted too
    assert read(redis_client, queue, rooms=(5, 5, 5)) == []


def test_a_new_lane_stream_gets_its_group_and_one_of_another_type_leaves_its_lane(redis_client, queue):
    enqueue(redis_client, queue, "a", ["flex"])
    assert read(redis_client, queue) == [("flex", "a", 1)]
    assert redis_client.xinfo_groups(KEYS.lane_stream(queue, "flex", "a"))[0]["name"] == GROUP
    enqueue(redis_client, queue, "b", ["flex"])
    enqueue(redis_client, queue, "c", ["flex"])
    stream = KEYS.lane_stream(queue, "flex", "b")
    redis_client.delete(stream)
    redis_client.set(stream, "x")
    reply = call(redis_client, worker.read(KEYS, queue, "w1", (5, 5, 5), DEFAULT_COST, {}))
    assert reply[0][:2] == ["!", stream] and "WRONGTYPE" in reply[0][2]
    assert [(lane, tenant) for lane, tenant, _ in reply[1:]] == [("flex", "c")]
    assert counter(redis_client, queue, "flex", "b") is None


def test_the_doorbell_rings_for_new_work_and_is_silenced_when_none_is_left(redis_client, queue):
    bell = KEYS.doorbell(queue)
    enqueue(redis_client, queue, "a", ["default"] * 3)
    enqueue(redis_client, queue, "b", ["flex"])
    assert redis_client.xlen(bell) == 2  # one per tenant that became active
    redis_client.delete(bell)
    read(redis_client, queue)  # work is left: one entry wakes an idle worker
    read(redis_client, queue)
    assert redis_client.xlen(bell) == 1
    read(redis_client, queue, rooms=(9, 9, 9))
    assert redis_client.xlen(bell) == 0
    for _ in range(DOORBELL_MAXLEN + 5):
        enqueue(redis_client, queue, uuid.uuid4().hex[:8], ["default"])
    assert redis_client.xlen(bell) == DOORBELL_MAXLEN


def test_an_idle_read_and_its_wait_are_two_round_trips_with_the_doorbell_looked_at_in_the_first(
    redis_client, queue, monkeypatch
):
    """A queue whose producers know no lanes never has a doorbell, so every wait of an idle worker
    would ask whether it is made yet: that EXISTS goes in the idle read's own pipeline, and the read
    and its wait are two round trips. Once a lane job made the doorbell, the wait after the next
    idle read gives it the group and blocks on it, as before."""
    q = WorkerQueue(redis_client, KEYS, queue, "w1")
    sent = []  # one packed command or pipeline each: a round trip
    connection = redis_client.connection_pool.connection_class
    send = connection.send_packed_command

    def counted(self, command, check_health=True):
        sent.append(command)
        return send(self, command, check_health)

    monkeypatch.setattr(connection, "send_packed_command", counted)
    assert q.reads.read((4, 4, 4), 5, []) == []  # the first loads the scripts
    for _ in range(3):
        sent.clear()
        assert q.reads.read((4, 4, 4), 5, []) == []
        assert len(sent) == 2  # READ (and the look), then the blocking XREADGROUP
    assert q.groups.rings == [False] and not redis_client.exists(KEYS.doorbell(queue))
    enqueue(redis_client, queue, "a", ["default"])
    [taken] = q.reads.read((4, 4, 4), 5, [])
    assert (taken.route.lane, taken.route.tenant) == ("default", "a")
    sent.clear()
    assert q.reads.read((4, 4, 4), 5, [taken.entry_id]) == []
    assert len(sent) == 3 and q.groups.rings == [True]  # and, once, the doorbell's group made
    assert [g["name"] for g in redis_client.xinfo_groups(KEYS.doorbell(queue))] == [GROUP]
    sent.clear()
    assert q.reads.read((4, 4, 4), 5, []) == []
    assert len(sent) == 2 and KEYS.doorbell(queue).encode() in sent[1][0]  # the wait blocks on it


def test_a_worker_with_room_for_priority_jobs_alone_looks_with_one_exists_until_one_waits(redis_client, queue):
    """A worker full of default jobs can take priority jobs only (the engine preempts for them):
    while none waits, each of its reads is one EXISTS of the priority lane, however much waits in
    the lower lanes; a priority job is taken by the read after it arrived, and acknowledgements
    still go with the next read."""
    q = WorkerQueue(redis_client, KEYS, queue, "w1")
    enqueue(redis_client, queue, "a", ["default", "flex"])
    redis_client.xadd(KEYS.queue(queue), {"id": "plain", "v": PROTOCOL_VERSION, "body": "{}"})
    redis_client.config_resetstat()
    assert [q.reads.read((4, 0, 0), None, []) for _ in range(20)] == [[]] * 20
    stats = redis_client.info("commandstats").items()
    assert {name: stat["calls"] for name, stat in stats if "config" not in name} == {"cmdstat_exists": 20}
    enqueue(redis_client, queue, "b", ["priority"])
    [taken] = q.reads.read((4, 0, 0), None, [])
    assert (taken.route.lane, taken.route.tenant) == ("priority", "b")
    redis_client.config_resetstat()
    assert q.reads.read((4, 0, 0), None, [taken.entry_id]) == []  # READ: the ack first, then nothing to read
    assert redis_client.info("commandstats")["cmdstat_evalsha"]["calls"] == 1
    assert redis_client.xpending(KEYS.lane_stream(queue, "priority", "b"), GROUP)["pending"] == 0
    assert read(redis_client, queue, rooms=(9, 9, 9)) == [("default", "-", 1), ("default", "a", 1), ("flex", "a", 1)]


def test_the_requests_limit_admits_a_full_bucket_then_its_rate(redis_client, queue):
    limits = Limits(rpm=600)  # 10 a second
    reply = enqueue(redis_client, queue, "a", ["default"] * 600, limits=limits)
    assert reply[:2] == [600, ""]
    assert reply[4:7] == [600, 0, pytest.approx(60_000, abs=50)]
    added, reason, retry_after_ms, which = enqueue(redis_client, queue, "a", ["default"], limits=limits)[:4]
    assert (added, reason, which) == (0, "rate", "requests") and 0 < retry_after_ms <= 100
    start, admitted = time.monotonic(), 0
    while time.monotonic() - start < 1.0:
        admitted += enqueue(redis_client, queue, "a", ["default"], limits=limits)[0]
    # Never more than the bucket (600) and the rate over the time that passed (10 a second).
    assert 8 <= admitted <= 10 * (time.monotonic() - start) + 1
    assert enqueue(redis_client, queue, "b", ["default"], limits=limits)[0] == 1  # each tenant its own


def test_the_tokens_limit_counts_each_jobs_cost_and_refuses_one_larger_than_a_minute(redis_client, queue):
    limits = Limits(tpm=1000)
    reply = enqueue(redis_client, queue, "a", ["default"] * 4, cost=300, limits=limits)
    assert reply[:4] == [3, "rate", reply[2], "tokens"]
    assert reply[7:9] == [1000, 100]
    assert enqueue(redis_client, queue, "b", ["default"], cost=1001, limits=limits)[:4] == [
        0,
        "too_large",
        1001,
        "1000",
    ]


def test_a_refused_job_counts_nothing_against_the_limits(redis_client, queue):
    limits = Limits(rpm=2, max_waiting=1)
    assert enqueue(redis_client, queue, "a", ["default"], limits=limits)[:2] == [1, ""]
    assert enqueue(redis_client, queue, "a", ["default"], limits=limits)[:2] == [0, "quota"]
    assert redis_client.hget(KEYS.rate(queue, "a"), "r") is not None
    remaining = enqueue(redis_client, queue, "a", ["flex"], limits=Limits(rpm=2))[5]
    assert remaining == 0  # the quota's refusal took nothing: this is the second of two


def test_the_waiting_quota_counts_unread_jobs_of_every_lane(redis_client, queue):
    limits = Limits(max_waiting=3)
    assert enqueue(redis_client, queue, "a", ["default", "flex", "priority", "flex"], limits=limits)[:4] == [
        3,
        "quota",
        3,
        "3",
    ]
    assert (
        enqueue(redis_client, queue, "b", ["default"], limits=limits)[0] == 1
    )  # another tenant's flood refuses nothing
    read(redis_client, queue, rooms=(1, 0, 0))  # a's priority job is read: it waits no more
    assert enqueue(redis_client, queue, "a", ["flex", "flex"], limits=limits)[:2] == [1, "quota"]


def test_the_depth_bound_is_each_streams(redis_client, queue):
    assert enqueue(redis_client, queue, "a", ["default"] * 3, max_depth=2)[:4] == [2, "full", 2, "default"]
    assert enqueue(redis_client, queue, "a", ["flex"], max_depth=2)[0] == 1
    assert enqueue(redis_client, queue, "b", ["default"] * 2, max_depth=2)[0] == 2


def test_reserving_counts_against_the_limits_and_adds_nothing(redis_client, queue):
    limits = Limits(rpm=5)
    assert enqueue(redis_client, queue, "a", ["default"] * 2, limits=limits, reserve=True)[:2] == [2, ""]
    assert redis_client.exists(KEYS.lane_stream(queue, "default", "a")) == 0
    assert counter(redis_client, queue, "default", "a") is None
    assert enqueue(redis_client, queue, "a", ["default"] * 5, limits=limits)[0] == 3


def test_reclaim_takes_idle_entries_of_every_lane_stream(redis_client, queue):
    enqueue(redis_client, queue, "a", ["flex", "priority"])
    enqueue(redis_client, queue, "b", ["default"])
    assert len(read(redis_client, queue, rooms=(5, 5, 5), consumer="dead")) == 3
    time.sleep(0.05)
    assert (
        call(redis_client, worker.reclaim_lanes(KEYS, queue, "w2", 10_000, 10, 0, HANDED))[1] == []
    )  # not idle enough
    next_start, taken = call(redis_client, worker.reclaim_lanes(KEYS, queue, "w2", 20, 2, 0, HANDED))
    assert sum(len(entries) for _, _, entries in taken) == 2
    _, rest = call(redis_client, worker.reclaim_lanes(KEYS, queue, "w2", 20, 10, next_start, HANDED))
    claimed = taken + rest
    assert sorted((lane, tenant) for lane, tenant, _ in claimed) == [("default", "b"), ("flex", "a"), ("priority", "a")]
    assert all((deliveries, handed) == (2, 0) for _, _, entries in claimed for _, _, deliveries, handed in entries)


def test_reclaim_says_which_lane_entries_a_drain_handed_over(redis_client, queue):
    enqueue(redis_client, queue, "a", ["flex", "flex"])
    assert read(redis_client, queue, rooms=(5, 5, 5)) == [("flex", "a", 2)]
    stream = KEYS.lane_stream(queue, "flex", "a")
    handed_id, idle_id = [entry_id for entry_id, _ in redis_client.xrange(stream)]
    time.sleep(0.05)
    assert call(redis_client, worker.release(stream, "w1", HANDED_OVER_IDLE_MS, [handed_id])) == 1
    _, claimed = call(redis_client, worker.reclaim_lanes(KEYS, queue, "w2", 20, 10, 0, HANDED))
    [(lane, tenant, entries)] = claimed
    assert (lane, tenant) == ("flex", "a")
    assert [(e, n, handed) for e, _, n, handed in entries] == [(handed_id, 1, 1), (idle_id, 2, 0)]


def test_a_revived_dead_letter_returns_to_its_lane_and_wakes_it(redis_client, queue):
    dead = KEYS.dead(queue)
    letter = redis_client.xadd(dead, {"id": "j1", "v": str(PROTOCOL_VERSION), "body": "{}"})
    call(redis_client, producer.revive(KEYS, queue, letter, "j1", str(PROTOCOL_VERSION), "{}", "flex", "a", "120"))
    assert redis_client.xlen(dead) == 0
    [(_, fields)] = redis_client.xrange(KEYS.lane_stream(queue, "flex", "a"))
    assert fields == {"id": "j1", "v": str(PROTOCOL_VERSION), "body": "{}", "cost": "120"}
    assert read(redis_client, queue) == [("flex", "a", 1)]
    assert (
        call(redis_client, producer.revive(KEYS, queue, letter, "j1", str(PROTOCOL_VERSION), "{}", "flex", "a", "120"))
        is None
    )


def test_an_entry_placed_on_a_workers_stream_carries_its_lane(redis_client):
    stream = KEYS.own_queue("q", "w1")
    pipe = redis_client.pipeline(transaction=False)
    producer.PlacedEntry(stream, "j1", "{}", {"lane": "flex", "tenant": "a", "cost": "9"}).add_to(pipe)
    pipe.execute()
    [(_, fields)] = redis_client.xrange(stream)
    assert fields == {"id": "j1", "v": str(PROTOCOL_VERSION), "body": "{}", "lane": "flex", "tenant": "a", "cost": "9"}


def test_read_given_the_workers_own_stream_reads_it_first_and_the_lanes_with_the_room_left(redis_client, queue):
    own = KEYS.own_queue(queue, "w1")
    redis_client.xgroup_create(own, GROUP, id="0", mkstream=True)

    def place(n):
        return [redis_client.xadd(own, {"id": uuid.uuid4().hex, "v": PROTOCOL_VERSION, "body": "{}"}) for _ in range(n)]

    def read_with_own(lane_rooms, own_room):
        """READ given the own stream: [(lane, tenant, entry ids)]."""
        reply = call(redis_client, worker.read(KEYS, queue, "w1", lane_rooms, DEFAULT_COST, {}, (own, own_room)))
        return [(lane, tenant, [entry_id for entry_id, _ in entries]) for lane, tenant, entries in reply]

    def counts(reply):
        return [(lane, tenant, len(ids)) for lane, tenant, ids in reply]

    placed = place(2)
    enqueue(redis_client, queue, "a", ["flex"] * 6)
    # The placed entries first, then the lanes with what is left of each room.
    first = read_with_own((3, 3, 3), 3)
    assert counts(first) == [("own", "", 2), ("flex", "a", 1)] and first[0][2] == placed
    place(1)
    assert counts(read_with_own((3, 3, 3), 3)) == [("own", "", 1), ("flex", "a", 2)]
    # Flex's room as given (the worker's flex read batch) where it is less than what is left.
    place(1)
    assert counts(read_with_own((9, 9, 1), 9)) == [("own", "", 1), ("flex", "a", 1)]
    # The placed entries fill the highest lane's room: the lanes are not read, the doorbell stays as it was.
    place(1)
    bell = redis_client.xrange(KEYS.doorbell(queue))
    assert counts(read_with_own((1, 1, 1), 1)) == [("own", "", 1)]
    assert redis_client.xrange(KEYS.doorbell(queue)) == bell != []
    assert counts(read_with_own((1, 1, 1), 1)) == [("flex", "a", 1)]  # none placed: the lanes' turn
    assert read(redis_client, queue, rooms=(9, 9, 9)) == [("flex", "a", 1)]


def plant_other_type(redis_client, key):
    redis_client.delete(key)
    redis_client.xadd(key, {"not": "ours"})


def test_a_lanes_sorted_set_of_another_type_is_made_anew_from_the_lane_streams(redis_client, queue):
    """Producers may write a lane's sorted set of active tenants (LUA_LANES): one of another type
    failed every READ, so the worker served nothing, plain jobs included, and every enqueue into the
    lane. READ makes it anew from the set of lane streams; an enqueue leaves it to READ."""
    enqueue(redis_client, queue, "a", ["flex"] * 2)
    enqueue(redis_client, queue, "b", ["flex"])
    redis_client.hset(KEYS.scheduler(queue), "c:flex:b", 50)  # b's saved counter, above the floor
    plant_other_type(redis_client, KEYS.lane(queue, "flex"))
    enqueue(redis_client, queue, "c", ["flex"])
    assert redis_client.type(KEYS.lane(queue, "flex")) == "stream"  # left to READ
    assert read(redis_client, queue, rooms=(0, 0, 0)) == []
    assert redis_client.zrange(KEYS.lane(queue, "flex"), 0, -1, withscores=True) == [("a", 0), ("c", 0), ("b", 50)]
    assert served_order(redis_client, queue, 4) == [("flex", "a"), ("flex", "c"), ("flex", "b"), ("flex", "a")]
    assert not redis_client.exists(KEYS.lane(queue, "flex"))  # every tenant read to its end


def test_a_correction_for_a_lane_whose_sorted_set_is_of_another_type_goes_to_the_saved_counter(redis_client, queue):
    """The corrections come first in READ, before the lanes' sets are looked at: a correction for a
    tenant of a lane whose set a producer made another type failed the READ (seen in CI: a worker's
    refusal, the read tried again with backoff). It goes to the tenant's saved counter, which the
    set made anew in the same READ lifts the tenant to."""
    enqueue(redis_client, queue, "a", ["flex"] * 3)
    read(redis_client, queue)  # a charged 100
    plant_other_type(redis_client, KEYS.lane(queue, "flex"))
    read(redis_client, queue, rooms=(0, 0, 0), corrections={("flex", "a"): 60})
    assert float(redis_client.hget(KEYS.scheduler(queue), "c:flex:a")) == 60
    assert redis_client.zrange(KEYS.lane(queue, "flex"), 0, -1, withscores=True) == [("a", 60)]


def test_a_scheduler_hash_of_another_type_reads_as_a_missing_one(redis_client, queue):
    """The DEL that changed its type took its state: every script reads it as the hash a DEL leaves
    (each field its default) and writes it anew, where each raised WRONGTYPE."""
    enqueue(redis_client, queue, "a", ["default"] * 3)
    plant_other_type(redis_client, KEYS.scheduler(queue))
    enqueue(redis_client, queue, "b", ["default"] * 3, limits=Limits(weight=2.0))
    assert redis_client.hgetall(KEYS.scheduler(queue)) == {"w:b": "2.0"}
    plant_other_type(redis_client, KEYS.scheduler(queue))
    order = [tenant for _, tenant in served_order(redis_client, queue, 6)]
    assert sorted(order) == ["a"] * 3 + ["b"] * 3
    assert redis_client.type(KEYS.scheduler(queue)) == "hash"


def test_a_set_of_lane_streams_of_another_type_is_made_anew(redis_client, queue):
    enqueue(redis_client, queue, "a", ["flex"])
    plant_other_type(redis_client, KEYS.lane_streams(queue))
    assert call(redis_client, worker.reclaim_lanes(KEYS, queue, "w1", 0, 10, 0, HANDED)) == [0, []]
    assert not redis_client.exists(KEYS.lane_streams(queue))
    plant_other_type(redis_client, KEYS.lane_streams(queue))
    enqueue(redis_client, queue, "b", ["default"])
    assert redis_client.smembers(KEYS.lane_streams(queue)) == {"default:b"}
