"""Dead letters on a real redis-server, through both clients: listed and found by entry or job id,
retried (the job queued again under its id, as a new entry with a fresh delivery count, its old
result, events and done entry gone, so that result() and stream() wait for the new run), refused
when the job did not fail, purged by id, all, or age. The letters are made as a worker makes them:
CLAIM, PUBLISH of the poison result, DEADLETTER (tests/chaos/test_dead_letter_commands.py makes
them by killing real workers)."""

from __future__ import annotations

import inspect
import json
import time

import pytest
import redis

from producer_client import JobFailed, JobTimeout
from producer_client.dead_letters import DeadLetterNotFound, NotRetryable
from producer_client.errors import InvalidArgument
from producer_client.keys import GROUP, PROTOCOL_VERSION, Keys
from producer_client.protocol.clock import entry_time
from producer_client.protocol.execution import execute
from producer_client.protocol.producer import RETRY
from producer_client.protocol.script import job_keys
from producer_client.protocol.worker import CLAIM, PUBLISH, WORKER_SCRIPTS, deadletter
from producer_client.schema import JobResult
from worker.loop.jobs import Poison, final_result
from worker.loop.outbox import DeadLetter as WorkerDeadLetter
from worker.loop.streams import DEAD_LETTER_MAXLEN

KEYS = Keys()
TTL_S = 60


def settle(client, value):
    """A DeadLetters/QueueInspector outcome: awaited on the SyncView's loop for the async client."""
    return client.loop.run_until_complete(value) if inspect.isawaitable(value) else value


def on_job(redis_client, script, job_id, *args):
    def add(pipe):
        pipe.evalsha(script.sha, 3, *job_keys(KEYS, job_id), *args)

    return execute(redis_client, add, WORKER_SCRIPTS)[0]


def take(redis_client, queue: str, worker: str = "w1") -> tuple[str, dict[str, str]]:
    """XREADGROUP one entry, as a worker does (the group made first, from id 0)."""
    try:
        redis_client.xgroup_create(KEYS.queue(queue), GROUP, id="0", mkstream=True)
    except redis.ResponseError:  # BUSYGROUP: made by an earlier take
        pass
    [(_, [(entry_id, fields)])] = redis_client.xreadgroup(GROUP, worker, {KEYS.queue(queue): ">"}, count=1)
    return entry_id, fields


def make_poison(redis_client, queue: str, job_id: str, deliveries: int = 3, final_status: str = "failed") -> str:
    """Take the job's entry, publish two tokens and the job's final result, then move the entry to
    the dead-letter stream: what a worker does to a poison job (final_status "failed"), or to an
    entry whose job ended elsewhere meanwhile (another final status). Returns the letter's id."""
    entry_id, fields = take(redis_client, queue)
    assert fields["id"] == job_id, "take() reads entries in order: make_poison jobs in the order submitted"
    assert on_job(redis_client, CLAIM, job_id, "w1", entry_id, TTL_S, "run-1")[0] == "claimed"
    if final_status == "failed":
        final = final_result(
            job_id,
            "failed",
            "error",
            "w1",
            time.time(),
            entry_time(entry_id),
            error=Poison("delivered 3 times"),
        )
    else:
        final = JobResult(id=job_id, status=final_status, text="ab", token_ids=[1, 2])
    tokens = json.dumps({"ids": [1, 2], "text": "ab"})
    assert (
        on_job(
            redis_client,
            PUBLISH,
            job_id,
            "run-1",
            '{"worker": "w1"}',
            tokens,
            0,
            2,
            final_status,
            final.model_dump_json(),
            TTL_S,
        )
        == "written"
    )
    letter = WorkerDeadLetter(entry_id, fields, "delivered 3 times", deliveries).letter("w1", time.time())
    call = deadletter(KEYS.queue(queue), KEYS.dead(queue), entry_id, DEAD_LETTER_MAXLEN, letter)
    assert execute(redis_client, call.add_to, WORKER_SCRIPTS) == [1]
    ((letter_id, _),) = redis_client.xrevrange(KEYS.dead(queue), count=1)
    return letter_id


def finish(redis_client, queue: str, job_id: str, text: str) -> tuple[str, int]:
    """A worker runs the retried entry to `done`; returns its entry id and delivery count."""
    entry_id, fields = take(redis_client, queue, "w2")
    assert fields["id"] == job_id, "take() reads entries in order: make_poison jobs in the order submitted"
    (pending,) = redis_client.xpending_range(KEYS.queue(queue), GROUP, entry_id, entry_id, 1)
    assert on_job(redis_client, CLAIM, job_id, "w2", entry_id, TTL_S, "run-2") == ["claimed", 0]
    ids = [ord(c) for c in text]
    result = JobResult(id=job_id, status="done", text=text, token_ids=ids, finish_reason="stop")
    tokens = json.dumps({"ids": ids, "text": text})
    assert (
        on_job(
            redis_client,
            PUBLISH,
            job_id,
            "run-2",
            '{"worker": "w2"}',
            tokens,
            0,
            len(ids),
            "done",
            result.model_dump_json(),
            TTL_S,
        )
        == "written"
    )
    redis_client.xack(KEYS.queue(queue), GROUP, entry_id)
    redis_client.xdel(KEYS.queue(queue), entry_id)
    return entry_id, pending["times_delivered"]


def test_a_letter_is_listed_and_found_by_its_entry_id_or_its_job_id(client, redis_client, queue):
    job_id = client.submit("poison", max_tokens=8, timeout_s=30)
    letter_id = make_poison(redis_client, queue, job_id)
    (letter,) = settle(client, client.dead_letters.list())
    assert (letter.letter_id, letter.job_id, letter.deliveries, letter.worker, letter.reason) == (
        letter_id,
        job_id,
        3,
        "w1",
        "delivered 3 times",
    )
    assert json.loads(letter.fields["body"]) == {"prompt": "poison", "params": {"max_tokens": 8}, "timeout_s": 30.0}
    assert abs(letter.dead_at - time.time()) < 5
    assert settle(client, client.dead_letters.get(letter_id)) == letter
    assert settle(client, client.dead_letters.get(job_id)) == letter
    with pytest.raises(DeadLetterNotFound):
        settle(client, client.dead_letters.get("no-such-job"))


def test_newest_letters_come_first_and_limit_bounds_them(client, redis_client, queue):
    jobs = [client.submit(f"p{i}", max_tokens=4) for i in range(3)]
    letters = [make_poison(redis_client, queue, job_id) for job_id in jobs]
    assert [d.letter_id for d in settle(client, client.dead_letters.list(limit=2))] == letters[::-1][:2]


def test_a_retried_job_runs_again_and_its_old_run_confuses_neither_result_nor_stream(client, redis_client, queue):
    job_id = client.submit("poison", max_tokens=8)
    letter_id = make_poison(redis_client, queue, job_id)
    with pytest.raises(JobFailed) as failed:
        client.result(job_id, timeout=1)
    assert failed.value.code == "poison"

    retried = settle(client, client.dead_letters.retry(letter_id))
    assert (retried.outcome, retried.job_id) == ("retried", job_id)
    assert client.status(job_id).status == "queued"
    assert redis_client.xlen(KEYS.dead(queue)) == 0
    ((entry_id, fields),) = redis_client.xrange(KEYS.queue(queue))
    assert entry_id == retried.entry_id and fields["id"] == job_id
    assert json.loads(fields["body"]) == {"prompt": "poison", "params": {"max_tokens": 8}}
    # The old run's end and tokens are gone: the readers wait for the new run.
    assert not redis_client.exists(KEYS.events(job_id), KEYS.done(job_id))
    assert redis_client.ttl(KEYS.job(job_id)) == -1  # live again: no result's TTL
    with pytest.raises(JobTimeout):
        client.result(job_id, timeout=0.3)
    with pytest.raises(JobTimeout):
        list(client.stream(job_id, timeout=0.3))

    new_entry, deliveries = finish(redis_client, queue, job_id, "fixed")
    assert (new_entry, deliveries) == (entry_id, 1)
    assert client.result(job_id, timeout=5).text == "fixed"
    assert "".join(d.text for d in client.stream(job_id, timeout=5)) == "fixed"
    assert client.status(job_id).status == "done"


def test_a_retry_gives_the_job_a_fresh_deadline(client, redis_client, queue):
    job_id = client.submit("poison", max_tokens=8, timeout_s=600)
    letter_id = make_poison(redis_client, queue, job_id)
    redis_client.hset(KEYS.job(job_id), "deadline", 1)  # long past
    settle(client, client.dead_letters.retry(letter_id))
    deadline_ms = int(redis_client.hget(KEYS.job(job_id), "deadline"))
    assert abs(deadline_ms / 1000 - (time.time() + 600)) < 5
    assert client.status(job_id).status == "queued"


def test_a_job_that_did_not_fail_is_refused_and_keeps_its_letter(client, redis_client, queue):
    job_id = client.submit("ended elsewhere", max_tokens=8)
    letter_id = make_poison(redis_client, queue, job_id, final_status="done")
    with pytest.raises(NotRetryable, match="is done: only a failed job is retried"):
        settle(client, client.dead_letters.retry(letter_id))
    assert [i for i, _ in redis_client.xrange(KEYS.dead(queue))] == [letter_id]
    assert client.result(job_id, timeout=1).text == "ab"
    assert redis_client.xlen(KEYS.queue(queue)) == 0


def test_a_letter_whose_job_expired_is_retried_as_a_new_job(client, redis_client, queue):
    job_id = client.submit("poison", max_tokens=8)
    letter_id = make_poison(redis_client, queue, job_id)
    redis_client.delete(*job_keys(KEYS, job_id))  # its result_ttl_s passed
    settle(client, client.dead_letters.retry(job_id))
    assert client.status(job_id).status == "queued"
    finish(redis_client, queue, job_id, "ok")
    assert client.result(job_id, timeout=5).text == "ok"
    with pytest.raises(DeadLetterNotFound):
        settle(client, client.dead_letters.retry(letter_id))  # done once: the letter is gone


def test_a_retry_stopped_half_way_is_finished_by_the_next(client, redis_client, queue):
    job_id = client.submit("poison", max_tokens=8)
    letter_id = make_poison(redis_client, queue, job_id)
    assert on_job(redis_client, RETRY, job_id, 0) == ["queued"]  # then the operator's process died
    settle(client, client.dead_letters.retry(letter_id))
    assert [f["id"] for _, f in redis_client.xrange(KEYS.queue(queue))] == [job_id]
    assert redis_client.xlen(KEYS.dead(queue)) == 0


def test_retry_all_retries_each_letter_and_reports_the_refused(client, redis_client, queue):
    failed = [client.submit(f"p{i}", max_tokens=4) for i in range(2)]
    ended = client.submit("ended", max_tokens=4)
    failed.append(client.submit("p2", max_tokens=4))
    letters = [make_poison(redis_client, queue, job_id) for job_id in failed[:2]]
    letters.append(make_poison(redis_client, queue, ended, final_status="cancelled"))
    letters.append(make_poison(redis_client, queue, failed[2]))
    outcomes = settle(client, client.dead_letters.retry_all())
    assert [(o.letter_id, o.outcome) for o in outcomes] == [
        (letters[0], "retried"),
        (letters[1], "retried"),
        (letters[2], "refused"),
        (letters[3], "retried"),
    ]
    assert "is cancelled" in outcomes[2].reason
    assert [f["id"] for _, f in redis_client.xrange(KEYS.queue(queue))] == [failed[0], failed[1], failed[2]]
    assert [i for i, _ in redis_client.xrange(KEYS.dead(queue))] == [letters[2]]


def test_purge_by_id_all_and_age(client, redis_client, queue):
    jobs = [client.submit(f"p{i}", max_tokens=4) for i in range(3)]
    letters = [make_poison(redis_client, queue, job_id) for job_id in jobs]
    purged = settle(client, client.dead_letters.purge(jobs[1]))
    assert purged.letter_id == letters[1]
    assert client.status(jobs[1]).status == "failed"  # the job itself stays as it ended
    assert [i for i, _ in redis_client.xrange(KEYS.dead(queue))] == [letters[0], letters[2]]
    with pytest.raises(DeadLetterNotFound):
        settle(client, client.dead_letters.purge(letters[1]))
    assert settle(client, client.dead_letters.purge_all()) == 2
    assert redis_client.xlen(KEYS.dead(queue)) == 0
    assert settle(client, client.dead_letters.purge_all()) == 0


def test_purge_older_than_removes_exactly_the_letters_past_the_age(client, redis_client, queue):
    now_ms = int(time.time() * 1000)
    ages_s = [600, 200, 61, 59, 10]  # the cut at 60 s, with letters well past it and well inside it
    for age in ages_s:
        redis_client.xadd(KEYS.dead(queue), {"id": f"job-{age}", "reason": "test"}, id=f"{now_ms - age * 1000}-0")
    assert settle(client, client.dead_letters.purge_older_than(60)) == 3
    assert [f["id"] for _, f in redis_client.xrange(KEYS.dead(queue))] == ["job-59", "job-10"]
    assert settle(client, client.dead_letters.purge_older_than(3600)) == 0


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda d: d.list(0), "limit"),
        (lambda d: d.list(10_001), "limit"),
        (lambda d: d.list("5"), "limit"),
        (lambda d: d.get("{bad}"), "id"),
        (lambda d: d.retry(""), "id"),
        (lambda d: d.purge(None), "id"),
        (lambda d: d.purge_older_than(0), "older_than"),
        (lambda d: d.purge_older_than(float("inf")), "older_than"),
        (lambda d: d.purge_older_than("1h"), "older_than"),
    ],
)
def test_bad_arguments_raise_before_anything_changes(client, redis_client, queue, call, field):
    job_id = client.submit("poison", max_tokens=4)
    make_poison(redis_client, queue, job_id)
    with pytest.raises(InvalidArgument) as e:
        call(client.dead_letters)
    assert e.value.field == field
    assert redis_client.xlen(KEYS.dead(queue)) == 1


def test_a_letter_without_a_job_id_is_not_retried(client, redis_client, queue):
    redis_client.xadd(KEYS.dead(queue), {"v": str(PROTOCOL_VERSION), "body": "{}", "reason": "raw XADD without an id"})
    (outcome,) = settle(client, client.dead_letters.retry_all())
    assert (outcome.outcome, outcome.reason) == ("refused", f"dead letter {outcome.letter_id} has no usable job id")
    assert redis_client.xlen(KEYS.queue(queue)) == 0


def test_a_dead_letter_stream_of_another_type_reads_as_one_with_no_letters(client, redis_client, queue):
    """An operator's SET on the dead-letter stream took its letters with the DEL that changed its
    type, and the next letter makes it a stream anew (DEADLETTER): meanwhile every read and purge
    answers as for a queue with no letters, never a raw WRONGTYPE."""
    client.submit("queued", max_tokens=4)
    redis_client.set(KEYS.dead(queue), "an operator's mistake")
    assert settle(client, client.dead_letters.list()) == []
    with pytest.raises(DeadLetterNotFound):
        settle(client, client.dead_letters.get("1-0"))
    with pytest.raises(DeadLetterNotFound):
        settle(client, client.dead_letters.purge("1-0"))
    assert settle(client, client.dead_letters.purge_all()) == 0
    assert settle(client, client.dead_letters.purge_older_than(60)) == 0
    assert settle(client, client.dead_letters.retry_all()) == []
    assert settle(client, client.inspect.overview()).dead == 0
    assert redis_client.get(KEYS.dead(queue)) == "an operator's mistake"  # reads change nothing
