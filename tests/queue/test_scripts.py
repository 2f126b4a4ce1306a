"""The protocol's Lua scripts on a real redis-server: each job status transition is atomic,
the queue bound is exact, the first finisher wins, a run fences off the runs before it, every
script is safe to run twice, and a queue's pending entries move only as the loop means them to."""

import json
import re
import time
import uuid

import pytest
import redis

from producer_client.keys import DONE_TTL_MS, GROUP, PROTOCOL_VERSION, Keys
from producer_client.protocol.execution import execute
from producer_client.protocol.producer import CANCEL, CREATE, ENQUEUE, PRODUCER_SCRIPTS
from producer_client.protocol.worker import (
    CLAIM,
    CLAIM_MANY,
    DEADLETTER,
    FAIL,
    PUBLISH,
    RECLAIM,
    REFRESH,
    RELEASE,
    WORKER_SCRIPTS,
    deadletter,
)
from producer_client.protocol.worker import (
    read as worker_read,
)
from producer_client.schema import JobResult
from worker.loop.outbox import DeadLetter
from worker.loop.queue import HANDED_OVER_MIN_IDLE_MS as HANDED
from worker.loop.streams import DEAD_LETTER_MAXLEN

KEYS = Keys()
ALL = (*PRODUCER_SCRIPTS, *WORKER_SCRIPTS)


@pytest.fixture
def job_id():
    return uuid.uuid4().hex


def run(redis_client, script, keys, *args):
    return execute(redis_client, lambda pipe: pipe.evalsha(script.sha, len(keys), *keys, *args), WORKER_SCRIPTS)[0]


def on_job(redis_client, script, job_id, *args):
    return run(redis_client, script, [KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id)], *args)


def events(redis_client, job_id):
    return [(f["type"], json.loads(f["data"])) for _, f in redis_client.xrange(KEYS.events(job_id))]


def final(job_id, status, text):
    """PUBLISH's final status and result JSON."""
    return status, JobResult(id=job_id, status=status, text=text).model_dump_json()


def publish(redis_client, job_id, run, start="", tokens="", before=0, after=0, status="", result=""):
    return on_job(redis_client, PUBLISH, job_id, run, start, tokens, before, after, status, result, 60)


def tokens(*ids):
    return json.dumps({"ids": list(ids), "text": "".join(chr(96 + i) for i in ids)})


def done_entries(redis_client, job_id):
    return [JobResult.model_validate_json(f["data"]) for _, f in redis_client.xrange(KEYS.done(job_id))]


@pytest.mark.parametrize("script", ALL, ids=lambda s: s.name)
def test_no_script_passes_unpack_anywhere_but_last_in_an_argument_list(script):
    # Lua truncates a call that is not the last expression of a list to its first value:
    # f(a, unpack(t), 'X') passes one element of t.
    for match in re.finditer(r"unpack\(", script.source):
        depth, end = 1, match.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(script.source[end], 0)
            end += 1
        following = script.source[end:].lstrip()
        assert not following.startswith(","), f"{script.name}: {script.source[match.start() : end]} is not last"


def test_scripts_load_on_a_server_that_lacks_them(redis_client, job_id):
    redis_client.script_flush()
    assert on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "run-1") == ["claimed", 0]
    assert all(redis_client.script_exists(*(s.sha for s in ALL)))


def test_enqueue_refuses_at_the_bound_and_never_trims(redis_client):
    queue = KEYS.queue(uuid.uuid4().hex)
    for i in range(2):
        added, entry_id = run(redis_client, ENQUEUE, [queue], 2, f"j{i}", PROTOCOL_VERSION, "{}")
        assert added == 1 and entry_id
    assert run(redis_client, ENQUEUE, [queue], 2, "j2", PROTOCOL_VERSION, "{}") == [0, 2]
    assert [f["id"] for _, f in redis_client.xrange(queue)] == ["j0", "j1"]
    assert run(redis_client, ENQUEUE, [queue], 0, "j3", PROTOCOL_VERSION, "{}")[0] == 1  # 0: no bound


def test_create_says_enqueue_until_an_enqueue_is_recorded(redis_client, job_id):
    key = KEYS.job(job_id)
    assert run(redis_client, CREATE, [key]) == 1  # new
    assert run(redis_client, CREATE, [key]) == 1  # queued, and no enqueue recorded: a submit stopped half-way
    redis_client.hset(key, "enqueued", "1")
    assert run(redis_client, CREATE, [key]) == 0
    redis_client.hset(key, mapping={"status": "running"})
    redis_client.hdel(key, "enqueued")
    assert run(redis_client, CREATE, [key]) == 0  # past queued: never set back
    assert redis_client.hget(key, "status") == "running"


def test_a_step_is_published_at_once_and_a_second_finisher_changes_nothing(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    assert on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1") == ["claimed", 0]
    start = json.dumps({"worker": "w1"})
    assert publish(redis_client, job_id, "r1", start, tokens(1, 2), 0, 2) == "ok"
    assert redis_client.hget(KEYS.job(job_id), "tokens") == "2"
    assert publish(redis_client, job_id, "r1", "", tokens(3), 2, 3, *final(job_id, "done", "abc")) == "written"
    assert publish(redis_client, job_id, "r1", "", tokens(4), 3, 4, *final(job_id, "failed", "second")) == "ended"
    job = redis_client.hgetall(KEYS.job(job_id))
    assert job["status"] == "done" and job["tokens"] == "3"
    assert JobResult.model_validate_json(job["result"]).text == "abc"
    assert [r.text for r in done_entries(redis_client, job_id)] == ["abc"]
    assert_kept_after_the_end(redis_client, job_id, events_kept=False)


def assert_kept_after_the_end(redis_client, job_id, events_kept):
    """What a job's end leaves (protocol v2): the hash with its result for the result TTL, the done
    stream for DONE_TTL_MS, the event stream only where kept, for the result TTL."""
    assert set(redis_client.hgetall(KEYS.job(job_id))) <= {"status", "result", "tokens", "fingerprint", "cancel"}
    assert 0 < redis_client.ttl(KEYS.job(job_id)) <= 60
    assert 0 < redis_client.pttl(KEYS.done(job_id)) <= DONE_TTL_MS
    if events_kept:
        assert 0 < redis_client.ttl(KEYS.events(job_id)) <= 60
    else:
        assert not redis_client.exists(KEYS.events(job_id))


def test_a_streamed_job_keeps_its_events_after_its_end(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), mapping={"status": "queued", "streamed": "1"})
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    assert publish(redis_client, job_id, "r1", json.dumps({"worker": "w1"}), tokens(1, 2), 0, 2) == "followed"
    assert publish(redis_client, job_id, "r1", "", tokens(3), 2, 3, *final(job_id, "done", "abc")) == "written"
    assert [t for t, _ in events(redis_client, job_id)] == ["start", "tokens", "tokens", "end"]
    assert events(redis_client, job_id)[-1][1]["text"] == "abc"
    assert_kept_after_the_end(redis_client, job_id, events_kept=True)


def test_a_job_its_run_streams_keeps_its_events_with_no_reader_yet(redis_client, job_id):
    # Submitted with stream=True: the run publishes as it streams, and its end keeps the events for
    # the reader to come, though no FOLLOW raised the hash's flag.
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    start = json.dumps({"worker": "w1"})
    args = ("r1", start, tokens(1), 0, 1, *final(job_id, "done", "a"), 60, "1")
    assert on_job(redis_client, PUBLISH, job_id, *args) == "written"
    assert [t for t, _ in events(redis_client, job_id)] == ["start", "tokens", "end"]
    assert_kept_after_the_end(redis_client, job_id, events_kept=True)


def test_a_job_that_ends_in_one_step_writes_no_event(redis_client, job_id):
    # Nobody streams it and one run made it: the events its final step would add would go at once.
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    start = json.dumps({"worker": "w1"})
    assert publish(redis_client, job_id, "r1", start, tokens(1), 0, 1, *final(job_id, "done", "a")) == "written"
    assert redis_client.xinfo_stream(KEYS.done(job_id))["entries-added"] == 1
    assert not redis_client.exists(KEYS.events(job_id))
    assert publish(redis_client, job_id, "r1", start, tokens(1), 0, 1, *final(job_id, "done", "a")) == "written"
    assert redis_client.xlen(KEYS.done(job_id)) == 1  # a retried final step writes nothing again


def test_a_publish_sent_twice_records_its_events_once(redis_client, job_id):
    # A retried call whose first reply was lost: the start once per run, tokens once per count.
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    for _ in range(2):
        assert publish(redis_client, job_id, "r1", json.dumps({"worker": "w1"}), tokens(1, 2), 0, 2) == "ok"
    for _ in range(2):
        assert publish(redis_client, job_id, "r1", "", tokens(3), 2, 3) == "ok"
    assert [(t, e.get("ids")) for t, e in events(redis_client, job_id)] == [
        ("start", None),
        ("tokens", [1, 2]),
        ("tokens", [3]),
    ]
    assert redis_client.hget(KEYS.job(job_id), "tokens") == "3"


def test_a_publish_whose_reply_was_lost_and_then_grew_reports_what_is_recorded(redis_client, job_id):
    # Redis went away after applying a call but before replying; the worker merged more steps
    # into the same update meanwhile. PUBLISH names the recorded count instead of fencing the run.
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    assert publish(redis_client, job_id, "r1", "", tokens(1, 2), 0, 2) == "ok"
    assert publish(redis_client, job_id, "r1", "", tokens(1, 2, 3), 0, 3) == "partial:2"
    assert publish(redis_client, job_id, "r2", "", tokens(1, 2, 3), 0, 3) == "lost"
    assert redis_client.hget(KEYS.job(job_id), "tokens") == "2"


def test_a_run_whose_tokens_do_not_follow_the_recorded_ones_is_lost(redis_client, job_id):
    # Redis lost its last writes (a crash under appendfsync everysec): the run stops, and the
    # job resumes from what Redis has, rather than leave a gap in the event stream.
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    publish(redis_client, job_id, "r1", "", tokens(1, 2), 0, 2)
    assert publish(redis_client, job_id, "r1", "", tokens(5), 4, 5) == "lost"
    assert publish(redis_client, job_id, "r1", "", "", 4, 4, *final(job_id, "done", "")) == "lost"
    assert redis_client.hget(KEYS.job(job_id), "tokens") == "2"
    assert "result" not in redis_client.hgetall(KEYS.job(job_id))


def test_a_reclaim_starts_a_new_run_that_fences_off_the_old_one(redis_client, job_id):
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    publish(redis_client, job_id, "r1", json.dumps({"worker": "w1"}), tokens(1, 2), 0, 2)
    # w1 stalls; w2 reclaims the same entry and learns how many tokens to resume after.
    assert on_job(redis_client, CLAIM, job_id, "w2", "1-0", 60, "r2") == ["claimed", 2]
    assert publish(redis_client, job_id, "r1", "", tokens(3), 2, 3) == "lost"
    assert publish(redis_client, job_id, "r1", "", tokens(3), 2, 3, *final(job_id, "done", "abc")) == "lost"
    assert publish(redis_client, job_id, "r2", json.dumps({"worker": "w2"}), tokens(3), 2, 3) == "ok"
    assert publish(redis_client, job_id, "r2", "", "", 3, 3, *final(job_id, "done", "abc")) == "written"
    assert [t for t, _ in events(redis_client, job_id)] == ["start", "tokens", "start", "tokens", "end"]
    assert JobResult.model_validate_json(redis_client.hget(KEYS.job(job_id), "result")).text == "abc"
    assert_kept_after_the_end(redis_client, job_id, events_kept=True)  # two runs published to it


def test_a_queued_job_cancelled_is_dropped_by_the_worker_that_reads_it(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    _, result = final(job_id, "cancelled", "")
    assert on_job(redis_client, CANCEL, job_id, result, 600) == "queued"
    assert redis_client.hget(KEYS.job(job_id), "status") == "cancelled"
    assert [r.status for r in done_entries(redis_client, job_id)] == ["cancelled"]
    assert 590 < redis_client.ttl(KEYS.job(job_id)) <= 600  # its keys go even if no worker reads the entry
    assert on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1") == ["final"]
    assert_kept_after_the_end(redis_client, job_id, events_kept=False)  # the claim starts the result TTL


def test_cancelling_a_running_job_raises_the_flag_its_next_step_reads(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    assert on_job(redis_client, CANCEL, job_id, "{}") == "running"
    job = redis_client.hgetall(KEYS.job(job_id))
    assert (job["status"], job["cancel"]) == ("running", "1")
    assert "result" not in job
    assert publish(redis_client, job_id, "r1") == "cancel"


def test_cancelling_an_unknown_job_returns_nil(redis_client, job_id):
    assert on_job(redis_client, CANCEL, job_id, "{}") is None
    assert not redis_client.exists(KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id))


def test_a_second_entry_of_a_running_job_is_a_duplicate(redis_client, job_id):
    assert on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1") == ["claimed", 0]  # raw XADD: no hash yet
    assert on_job(redis_client, CLAIM, job_id, "w2", "2-0", 60, "r2") == ["duplicate"]
    assert redis_client.hget(KEYS.job(job_id), "worker") == "w1"


# -- a queue's pending entries -------------------------------------------------------------------


@pytest.fixture
def stream(redis_client):
    key = KEYS.queue(uuid.uuid4().hex)
    redis_client.xgroup_create(key, GROUP, id="0", mkstream=True)
    return key


def deliver(redis_client, stream, consumer, n):
    ids = [redis_client.xadd(stream, {"id": f"j{i}", "v": str(PROTOCOL_VERSION), "body": "{}"}) for i in range(n)]
    redis_client.xreadgroup(GROUP, consumer, {stream: ">"}, count=n)
    return ids


def pending(redis_client, stream):
    """{entry id: (consumer, delivery count)}"""
    rows = redis_client.xpending_range(stream, GROUP, "-", "+", 100)
    return {r["message_id"]: (r["consumer"], r["times_delivered"]) for r in rows}


def test_refresh_keeps_a_live_workers_entries_and_reports_those_taken_from_it(redis_client, stream):
    a, b = deliver(redis_client, stream, "w1", 2)
    time.sleep(0.05)
    redis_client.xclaim(stream, GROUP, "w2", 0, [b])  # reclaimed while w1 was cut off
    assert run(redis_client, REFRESH, [stream], GROUP, "w1", a, b) == [b]
    assert pending(redis_client, stream) == {a: ("w1", 1), b: ("w2", 2)}  # b stays w2's: not taken back
    assert run(redis_client, RECLAIM, [stream], GROUP, "w3", 40, "0-0", 10, HANDED)[1] == []  # a is fresh again


def test_refresh_resets_the_idle_time_of_every_entry_it_holds(redis_client, stream):
    held = deliver(redis_client, stream, "w1", 5)
    time.sleep(0.2)
    assert run(redis_client, REFRESH, [stream], GROUP, "w1", *held) == []
    assert run(redis_client, RECLAIM, [stream], GROUP, "w2", 150, "0-0", 10, HANDED)[1] == []  # none idle
    assert pending(redis_client, stream) == {entry_id: ("w1", 1) for entry_id in held}


def test_a_pipeline_resent_after_noscript_reads_the_queue_once(redis_client, stream):
    deliver(redis_client, stream, "w1", 1)
    ids = [redis_client.xadd(stream, {"id": f"n{i}", "v": str(PROTOCOL_VERSION), "body": "{}"}) for i in range(3)]
    redis_client.script_flush()

    def refresh_and_read(pipe):
        pipe.evalsha(REFRESH.sha, 1, stream, GROUP, "w2")
        pipe.xreadgroup(GROUP, "w2", {stream: ">"}, count=2)

    replies = execute(redis_client, refresh_and_read, WORKER_SCRIPTS)
    assert replies[0] == []  # the script ran once the scripts were loaded
    read = [entry_id for entry_id, _ in replies[1][0][1]]
    assert read == ids[:2]
    # What the caller got is exactly what is pending for it: no second read happened.
    assert sorted(e for e, (consumer, _) in pending(redis_client, stream).items() if consumer == "w2") == read


def test_reclaim_takes_idle_entries_with_their_delivery_count_and_no_more_than_asked(redis_client, stream):
    first = deliver(redis_client, stream, "w1", 3)
    time.sleep(0.05)
    cursor, claimed = run(redis_client, RECLAIM, [stream], GROUP, "w2", 40, "0-0", 2, HANDED)
    assert [(entry_id, dict(zip(f[::2], f[1::2]))["id"], n, handed) for entry_id, f, n, handed in claimed] == [
        (first[0], "j0", 2, 0),
        (first[1], "j1", 2, 0),
    ]
    assert cursor == first[2]  # the next scan starts at the entry this one left
    assert run(redis_client, RECLAIM, [stream], GROUP, "w2", 40, cursor, 2, HANDED)[1][0][0] == first[2]
    assert run(redis_client, RECLAIM, [stream], GROUP, "w3", 40, "0-0", 5, HANDED)[1] == []  # all just claimed


def test_a_released_entry_is_reclaimed_at_once_as_handed_over_without_counting_a_delivery(redis_client, stream):
    (entry_id, idle_id) = deliver(redis_client, stream, "w1", 2)
    time.sleep(0.05)
    assert run(redis_client, RELEASE, [stream], GROUP, "w1", 10**10, entry_id, "0-1") == 1  # 0-1: not w1's
    _, claimed = run(redis_client, RECLAIM, [stream], GROUP, "w2", 40, "0-0", 5, HANDED)
    assert [(e, n, handed) for e, _, n, handed in claimed] == [(entry_id, 1, 1), (idle_id, 2, 0)]


def test_a_dead_letter_moves_its_entry_once(redis_client, stream):
    (entry_id,) = deliver(redis_client, stream, "w1", 1)
    dead = KEYS.dead(stream.removeprefix("mili:q:{").removesuffix("}"))
    args = [GROUP, entry_id, 100, "id", "j0", "reason", "poison"]
    assert run(redis_client, DEADLETTER, [stream, dead], *args) == 1
    assert run(redis_client, DEADLETTER, [stream, dead], *args) == 0
    assert [f for _, f in redis_client.xrange(dead)] == [{"id": "j0", "reason": "poison"}]
    assert redis_client.xlen(stream) == 0 and pending(redis_client, stream) == {}


def test_a_dead_letter_of_an_entry_with_thousands_of_fields_keeps_the_protocols_own(redis_client, stream):
    fields = {"id": "j0", "v": str(PROTOCOL_VERSION), "body": "{}", **{f"f{i}": "x" for i in range(5000)}}
    entry_id = redis_client.xadd(stream, fields)
    redis_client.xreadgroup(GROUP, "w1", {stream: ">"})
    dead = KEYS.dead(stream.removeprefix("mili:q:{").removesuffix("}"))
    letter = DeadLetter(entry_id, fields, "poison", 4)
    assert (
        run(
            redis_client,
            DEADLETTER,
            [stream, dead],
            *deadletter(stream, dead, entry_id, DEAD_LETTER_MAXLEN, letter.letter("w1", 1.0)).args,
        )
        == 1
    )
    (moved,) = [f for _, f in redis_client.xrange(dead)]
    assert {k: moved[k] for k in ("id", "v", "body", "entry", "reason", "deliveries")} == {
        "id": "j0",
        "v": str(PROTOCOL_VERSION),
        "body": "{}",
        "entry": entry_id,
        "reason": "poison",
        "deliveries": "4",
    }
    assert not any(name.startswith("f") and name[1:].isdigit() for name in moved)


@pytest.mark.parametrize(
    "key, make",
    [
        ("job", lambda r, key: r.xadd(key, {"a": "b"})),
        ("events", lambda r, key: r.hset(key, "a", "b")),
        ("done", lambda r, key: r.hset(key, "a", "b")),
    ],
)
def test_claim_and_publish_refuse_a_job_key_of_another_type_before_writing_anything(redis_client, job_id, key, make):
    job_key = {"job": KEYS.job, "events": KEYS.events, "done": KEYS.done}[key](job_id)
    make(redis_client, job_key)
    if key != "job":
        redis_client.hset(KEYS.job(job_id), mapping={"status": "running", "run": "r1"})
    before = {k: redis_client.dump(k) for k in (KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id))}
    with pytest.raises(redis.ResponseError, match=f"WRONGTYPE {re.escape(job_key)} is a"):
        on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    final_step = ("r1", "{}", tokens(1), 0, 1, *final(job_id, "done", "a"), 60)
    steps = [final_step] if key == "done" else [final_step, ("r1", "{}", tokens(1), 0, 1, "", "", 60)]
    for args in steps:  # the last step, and (but for the done stream, which only it writes) one before
        with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
            on_job(redis_client, PUBLISH, job_id, *args)
    assert {k: redis_client.dump(k) for k in before} == before  # nothing written


def test_claim_many_answers_each_job_as_its_own_claim_and_refuses_a_job_of_another_key_type_alone(redis_client):
    fresh, hostile, ended, resumed = (uuid.uuid4().hex for _ in range(4))
    redis_client.hset(KEYS.events(hostile), "a", "b")
    redis_client.hset(KEYS.job(ended), mapping={"status": "done", "result": "{}"})
    redis_client.hset(KEYS.job(resumed), mapping={"status": "running", "entry": "4-0", "tokens": "3", "deadline": "9"})
    jobs = [
        (fresh, "1-0", "r1"),
        (hostile, "2-0", "r2"),
        (ended, "3-0", "r3"),
        (resumed, "4-0", "r4"),
        (fresh, "5-0", "r5"),
    ]
    call_keys = [key for job_id, _, _ in jobs for key in (KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id))]
    replies = run(redis_client, CLAIM_MANY, call_keys, "w1", 60, *(x for _, entry, run_ in jobs for x in (entry, run_)))
    assert isinstance(replies[1], redis.ResponseError)
    assert str(replies[1]) == f"WRONGTYPE {KEYS.events(hostile)} is a hash, not a stream"
    # the same entry of a job claimed twice in one call: the second is a duplicate, as in two calls
    assert replies[:1] + replies[2:] == [["claimed", 0], ["final"], ["claimed", 3, "9"], ["duplicate"]]
    assert redis_client.hgetall(KEYS.job(fresh)) == {"status": "running", "worker": "w1", "entry": "1-0", "run": "r1"}
    assert redis_client.hget(KEYS.job(resumed), "run") == "r4"
    assert redis_client.ttl(KEYS.job(ended)) == 60
    assert not redis_client.exists(KEYS.job(hostile))


def test_fail_replaces_keys_of_another_type_and_writes_the_failure_once(redis_client, job_id):
    redis_client.xadd(KEYS.job(job_id), {"a": "b"})
    redis_client.hset(KEYS.events(job_id), "a", "b")
    result = JobResult(id=job_id, status="failed", text="ab", token_ids=[1, 2])
    assert on_job(redis_client, FAIL, job_id, result.model_dump_json(), 2, 60) == "failed"
    assert redis_client.hgetall(KEYS.job(job_id)) == {
        "status": "failed",
        "result": result.model_dump_json(),
        "tokens": "2",
    }
    assert done_entries(redis_client, job_id) == [result]
    assert_kept_after_the_end(redis_client, job_id, events_kept=False)  # no run published to it
    assert on_job(redis_client, FAIL, job_id, result.model_dump_json(), 2, 60) == "ended"  # once
    assert done_entries(redis_client, job_id) == [result]


def test_a_failed_job_keeps_the_events_its_runs_published_and_its_request_fingerprint(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), mapping={"status": "queued", "fingerprint": "f1", "enqueued": "1"})
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60, "r1")
    assert publish(redis_client, job_id, "r1", json.dumps({"worker": "w1"}), tokens(1, 2), 0, 2) == "ok"
    result = JobResult(id=job_id, status="failed", text="ab", token_ids=[1, 2])
    assert on_job(redis_client, FAIL, job_id, result.model_dump_json(), 2, 60) == "failed"
    assert [t for t, _ in events(redis_client, job_id)] == ["start", "tokens", "end"]
    assert redis_client.hgetall(KEYS.job(job_id)) == {
        "status": "failed",
        "result": result.model_dump_json(),
        "tokens": "2",
        "fingerprint": "f1",
    }
    assert_kept_after_the_end(redis_client, job_id, events_kept=True)
    assert run(redis_client, CREATE, [KEYS.job(job_id)], 0, "f2") == -1  # its request_id stays bound
    assert run(redis_client, CREATE, [KEYS.job(job_id)], 0, "f1") == 0  # and is not run again


@pytest.mark.parametrize("counter", ["zz", "nan", "inf"])
def test_read_adds_a_correction_to_an_idle_tenants_counter_that_is_no_number_from_zero(redis_client, counter):
    """Producers may HSET the scheduler hash: a counter of theirs that is no number is 0 to READ,
    which then applies what the worker owes, where HINCRBYFLOAT refused the whole READ."""
    keys, queue = Keys(), f"q-{uuid.uuid4().hex[:8]}"
    redis_client.xgroup_create(keys.queue(queue), GROUP, id="0", mkstream=True)
    redis_client.hset(keys.scheduler(queue), "c:flex:team-q", counter)
    call = worker_read(keys, queue, "w1", (1, 1, 1), 320, {("flex", "team-q"): 40})
    execute(redis_client, call.add_to, WORKER_SCRIPTS)
    assert float(redis_client.hget(keys.scheduler(queue), "c:flex:team-q")) == 40.0


@pytest.mark.parametrize("key", ["events", "done"])
def test_cancel_of_a_queued_job_refuses_a_stream_of_another_type_before_writing_anything(redis_client, job_id, key):
    """As the worker's scripts: CANCEL rewrote the job's hash as cancelled before its XADD met a
    done stream (or kept events) of another type, and failed with part of the job's end written."""
    redis_client.hset(KEYS.job(job_id), mapping={"status": "queued", "streamed": "1"})
    redis_client.hset({"events": KEYS.events, "done": KEYS.done}[key](job_id), "a", "b")
    before = {k: redis_client.dump(k) for k in (KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id))}
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        on_job(redis_client, CANCEL, job_id, final(job_id, "cancelled", "")[1], 600)
    assert {k: redis_client.dump(k) for k in before} == before  # nothing written
