"""The protocol's Lua scripts on a real redis-server: each job status transition is atomic,
and the first finisher wins."""
import json
import uuid

import pytest

from producer_client.keys import Keys
from producer_client.schema import JobResult
from producer_client.scripts import CANCEL_JOB, CLAIM_JOB, FINISH_JOB

KEYS = Keys()


@pytest.fixture
def job_id():
    return uuid.uuid4().hex


def run(redis_client, script, job_id, *args):
    return redis_client.register_script(script)(keys=[KEYS.job(job_id), KEYS.events(job_id)], args=list(args))


def events(redis_client, job_id):
    return [(f["type"], json.loads(f["data"])) for _, f in redis_client.xrange(KEYS.events(job_id))]


def result_json(job_id, status, text):
    return JobResult(id=job_id, status=status, text=text).model_dump_json()


def test_a_second_finisher_changes_nothing(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    assert run(redis_client, CLAIM_JOB, job_id, "w1", "1-0", "{}", 60) == "claimed"
    assert run(redis_client, FINISH_JOB, job_id, "done", result_json(job_id, "done", "first"), 3, 60) == 1
    assert run(redis_client, FINISH_JOB, job_id, "failed", result_json(job_id, "failed", "second"), 0, 60) == 0
    job = redis_client.hgetall(KEYS.job(job_id))
    assert job["status"] == "done" and job["tokens"] == "3"
    assert JobResult.model_validate_json(job["result"]).text == "first"
    assert [t for t, _ in events(redis_client, job_id)] == ["start", "end"]
    assert 0 < redis_client.ttl(KEYS.job(job_id)) <= 60
    assert 0 < redis_client.ttl(KEYS.events(job_id)) <= 60


def test_a_queued_job_cancelled_is_dropped_by_the_worker_that_reads_it(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    assert run(redis_client, CANCEL_JOB, job_id, result_json(job_id, "cancelled", "")) == "queued"
    assert redis_client.hget(KEYS.job(job_id), "status") == "cancelled"
    assert run(redis_client, CLAIM_JOB, job_id, "w1", "1-0", "{}", 60) == "final"
    assert [t for t, _ in events(redis_client, job_id)] == ["end"]
    assert 0 < redis_client.ttl(KEYS.job(job_id)) <= 60  # the worker's claim starts the result TTL


def test_cancelling_a_running_job_only_raises_its_flag(redis_client, job_id):
    redis_client.hset(KEYS.job(job_id), "status", "queued")
    run(redis_client, CLAIM_JOB, job_id, "w1", "1-0", "{}", 60)
    assert run(redis_client, CANCEL_JOB, job_id, "{}") == "running"
    job = redis_client.hgetall(KEYS.job(job_id))
    assert (job["status"], job["cancel"]) == ("running", "1")
    assert "result" not in job


def test_cancelling_an_unknown_job_returns_nil(redis_client, job_id):
    assert run(redis_client, CANCEL_JOB, job_id, "{}") is None
    assert not redis_client.exists(KEYS.job(job_id), KEYS.events(job_id))


def test_a_second_entry_of_a_running_job_is_a_duplicate(redis_client, job_id):
    assert run(redis_client, CLAIM_JOB, job_id, "w1", "1-0", "{}", 60) == "claimed"  # raw XADD: no hash yet
    assert run(redis_client, CLAIM_JOB, job_id, "w2", "2-0", "{}", 60) == "duplicate"
    assert redis_client.hget(KEYS.job(job_id), "worker") == "w1"


def test_a_failure_without_a_claim_creates_the_job(redis_client, job_id):
    assert run(redis_client, FINISH_JOB, job_id, "failed", result_json(job_id, "failed", ""), 0, 60) == 1
    assert redis_client.hget(KEYS.job(job_id), "status") == "failed"
    assert [t for t, _ in events(redis_client, job_id)] == ["end"]
