"""The protocol's Lua scripts on a real redis-server: each job status transition is atomic,
the queue bound is exact, and the first finisher wins."""
import json
import uuid

import pytest

from producer_client.keys import PROTOCOL_VERSION, Keys
from producer_client.schema import JobResult
from producer_client.scripts import ALL, CANCEL, CLAIM, ENQUEUE, PUBLISH, execute

KEYS = Keys()


@pytest.fixture
def job_id():
    return uuid.uuid4().hex


def run(redis_client, script, keys, *args):
    return execute(redis_client, lambda pipe: pipe.evalsha(script.sha, len(keys), *keys, *args))[0]


def on_job(redis_client, script, job_id, *args):
    return run(redis_client, script, [KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id)], *args)


def events(redis_client, job_id):
    return [(f["type"], json.loads(f["data"])) for _, f in redis_client.xrange(KEYS.events(job_id))]


def final(job_id, status, text):
    """PUBLISH's final status and result JSON."""
    return status, JobResult(id=job_id, status=status, text=text).model_dump_json()


def done_entries(redis_client, job_id):
    return [JobResult.model_validate_json(f["data"]) for _, f in redis_client.xrange(KEYS.done(job_id))]


def test_scripts_load_on_a_server_that_lacks_them(redis_client, job_id):
    redis_client.script_flush()
    assert on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60) == "claimed"
    assert all(redis_client.script_exists(*(s.sha for s in ALL)))


def test_enqueue_refuses_at_the_bound_and_never_trims(redis_client):
    queue = KEYS.queue(uuid.uuid4().hex)
    for i in range(2):
        added, entry_id = run(redis_client, ENQUEUE, [queue], 2, f"j{i}", PROTOCOL_VERSION, "{}")
        assert added == 1 and entry_id
    assert run(redis_client, ENQUEUE, [queue], 2, "j2", PROTOCOL_VERSION, "{}") == [0, 2]
    assert [f["id"] for _, f in redis_client.xrange(queue)] == ["j0", "j1"]
    assert run(redis_client, ENQUEUE, [queue], 0, "j3", PROTOCOL_VERSION, "{}")[0] == 1  # 0: no bound


def test_a_step_is_published_at_once_and_a_second_finisher_changes_nothing(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    assert on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60) == "claimed"
    start, tokens = json.dumps({"worker": "w1"}), json.dumps({"ids": [1, 2], "text": "ab"})
    assert on_job(redis_client, PUBLISH, job_id, start, tokens, 2, "", "", 60) is None  # goes on, not cancelled
    assert redis_client.hget(KEYS.job(job_id), "tokens") == "2"
    last = json.dumps({"ids": [3], "text": "c"})
    assert on_job(redis_client, PUBLISH, job_id, "", last, 3, *final(job_id, "done", "abc"), 60) == 1
    assert on_job(redis_client, PUBLISH, job_id, "", tokens, 9, *final(job_id, "failed", "second"), 60) == 0
    job = redis_client.hgetall(KEYS.job(job_id))
    assert job["status"] == "done" and job["tokens"] == "3"
    assert JobResult.model_validate_json(job["result"]).text == "abc"
    assert [t for t, _ in events(redis_client, job_id)] == ["start", "tokens", "tokens", "end"]
    assert events(redis_client, job_id)[-1][1]["text"] == "abc"
    assert [r.text for r in done_entries(redis_client, job_id)] == ["abc"]
    for key in (KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id)):
        assert 0 < redis_client.ttl(key) <= 60


def test_a_queued_job_cancelled_is_dropped_by_the_worker_that_reads_it(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    _, result = final(job_id, "cancelled", "")
    assert on_job(redis_client, CANCEL, job_id, result) == "queued"
    assert redis_client.hget(KEYS.job(job_id), "status") == "cancelled"
    assert [r.status for r in done_entries(redis_client, job_id)] == ["cancelled"]
    assert on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60) == "final"
    assert [t for t, _ in events(redis_client, job_id)] == ["end"]
    for key in (KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id)):
        assert 0 < redis_client.ttl(key) <= 60  # the worker's claim starts the result TTL


def test_cancelling_a_running_job_raises_the_flag_its_next_step_reads(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60)
    assert on_job(redis_client, CANCEL, job_id, "{}") == "running"
    job = redis_client.hgetall(KEYS.job(job_id))
    assert (job["status"], job["cancel"]) == ("running", "1")
    assert "result" not in job
    assert on_job(redis_client, PUBLISH, job_id, "", "", 0, "", "", 60) == "1"


def test_cancelling_an_unknown_job_returns_nil(redis_client, job_id):
    assert on_job(redis_client, CANCEL, job_id, "{}") is None
    assert not redis_client.exists(KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id))


def test_a_second_entry_of_a_running_job_is_a_duplicate(redis_client, job_id):
    assert on_job(redis_client, CLAIM, job_id, "w1", "1-0", 60) == "claimed"  # raw XADD: no hash yet
    assert on_job(redis_client, CLAIM, job_id, "w2", "2-0", 60) == "duplicate"
    assert redis_client.hget(KEYS.job(job_id), "worker") == "w1"


def test_a_failure_without_a_claim_creates_the_job(redis_client, job_id):
    assert on_job(redis_client, PUBLISH, job_id, "", "", 0, *final(job_id, "failed", ""), 60) == 1
    assert redis_client.hget(KEYS.job(job_id), "status") == "failed"
    assert [t for t, _ in events(redis_client, job_id)] == ["end"]
