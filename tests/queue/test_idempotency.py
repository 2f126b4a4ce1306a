"""A request_id is bound to the request that first used it: the same id with the same prompt and
sampling parameters finds the same job (whatever its deadline, counted from each retry), with
another it raises IdempotencyConflict and enqueues nothing; in submit_many too."""

from __future__ import annotations

import uuid

import pytest
import redis

from producer_client import IdempotencyConflict, InvalidArgument, bulk
from producer_client.keys import Keys
from tests.support.clients import make_client
from tests.support.jobs import entries_added

KEYS = Keys()


def test_the_same_request_id_with_the_same_request_finds_the_same_job(client, redis_client, queue):
    request_id = f"r-{uuid.uuid4().hex}"
    first = client.submit(prompt="same", max_tokens=8, request_id=request_id, timeout_s=60)
    again = client.submit(prompt="same", max_tokens=8, request_id=request_id, timeout_s=30)
    assert first == again == request_id
    assert redis_client.xlen(KEYS.queue(queue)) == 1


@pytest.mark.parametrize(
    "change", [{"prompt": "other"}, {"max_tokens": 9}, {"temperature": 0.5}, {"request_fingerprint": "f2"}]
)
def test_the_same_request_id_with_another_request_is_refused_and_enqueues_nothing(client, redis_client, queue, change):
    request_id = f"r-{uuid.uuid4().hex}"
    request = {"prompt": "same", "max_tokens": 8, "request_id": request_id}
    client.submit(**request, **({"request_fingerprint": "f1"} if "request_fingerprint" in change else {}))
    with pytest.raises(IdempotencyConflict) as e:
        client.submit(**{**request, **change})
    assert e.value.code == "idempotency_conflict" and e.value.request_id == request_id
    assert redis_client.xlen(KEYS.queue(queue)) == 1
    assert redis_client.hget(KEYS.job(request_id), "status") == "queued"


def test_a_request_id_whose_job_key_is_of_another_type_is_another_requests_and_enqueues_nothing(
    client, redis_client, queue
):
    """A producer may write a job's keys: a request id whose job key is no hash names no request of
    this one's, as one first used with another request (a gateway's Idempotency-Key: its 422)."""
    request_id = f"r-{uuid.uuid4().hex}"
    redis_client.xadd(KEYS.job(request_id), {"not": "a hash"})
    with pytest.raises(IdempotencyConflict) as e:
        client.submit(prompt="planted", max_tokens=8, request_id=request_id)
    assert e.value.request_id == request_id
    with pytest.raises(IdempotencyConflict):
        client.submit_many([{"prompt": "planted", "request_id": request_id}])
    assert not redis_client.exists(KEYS.queue(queue))
    assert redis_client.type(KEYS.job(request_id)) == "stream"


def test_a_request_id_that_names_a_tenant_not_the_clients_is_refused_before_anything_is_enqueued(
    client, client_kind, redis_server, redis_client, queue
):
    """A job's tenant is its id's up to the first '.': `team-a.x` from a client of no tenant (or of
    team-b) made a job that team-a's gateway key and team-a's pinned Redis user took for theirs,
    charged to another's lanes and limits. Refused, typed, before anything is written; an id of
    the client's own tenant, or of none without a '.', stays as given."""
    team_b = make_client(client_kind, redis_server.url, queue, tenant="team-b")
    try:
        refusals = [
            ("request_id", lambda: client.submit(prompt="x", max_tokens=1, request_id="team-a.x")),
            (
                "jobs[1].request_id",
                lambda: client.submit_many([{"prompt": "ok"}, {"prompt": "x", "request_id": "team-a.x"}]),
            ),
            ("request_id", lambda: team_b.submit(prompt="x", max_tokens=1, request_id="team-a.x")),
            ("jobs[0].request_id", lambda: team_b.submit_many([{"prompt": "x", "request_id": "team-a.x"}])),
        ]
        for field, refused in refusals:
            with pytest.raises(InvalidArgument) as e:
                refused()
            assert e.value.field == field and "names tenant 'team-a'" in e.value.detail, e.value
        assert entries_added(redis_client, queue) == 0 and not redis_client.exists(KEYS.job("team-a.x"))
        own, none = f"team-b.order-{uuid.uuid4().hex}", f"order-{uuid.uuid4().hex}"
        assert team_b.submit(prompt="b", max_tokens=1, request_id=own) == own
        assert client.submit(prompt="none", max_tokens=1, request_id=none) == none
    finally:
        team_b.close()
    assert entries_added(redis_client, queue) == 2


def test_submit_many_refuses_a_chunk_with_a_request_id_of_another_request(client, redis_client, queue):
    taken = f"r-{uuid.uuid4().hex}"
    client.submit(prompt="first", request_id=taken)
    fresh = f"r-{uuid.uuid4().hex}"
    with pytest.raises(IdempotencyConflict):
        client.submit_many([{"prompt": "new", "request_id": fresh}, {"prompt": "second", "request_id": taken}])
    assert redis_client.xlen(KEYS.queue(queue)) == 1
    assert not redis_client.exists(KEYS.job(fresh))
    assert client.submit_many([{"prompt": "new", "request_id": fresh}, {"prompt": "first", "request_id": taken}]) == [
        fresh,
        taken,
    ]


def test_submit_many_refuses_a_request_id_given_twice_in_one_call_with_two_requests(client, redis_client, queue):
    """The second spec's id answered with the first's job (its prompt's text), where a later call
    of the same id raised IdempotencyConflict. Refused before anything is sent; the same request
    twice is still one job."""
    request_id = f"r-{uuid.uuid4().hex}"
    with pytest.raises(IdempotencyConflict) as e:
        client.submit_many([{"prompt": "a", "request_id": request_id}, {"prompt": "b", "request_id": request_id}])
    assert e.value.request_id == request_id
    assert not redis_client.exists(KEYS.queue(queue), KEYS.job(request_id))
    twice = [{"prompt": "a", "request_id": request_id}] * 2
    assert client.submit_many(twice) == [request_id, request_id]
    assert redis_client.xlen(KEYS.queue(queue)) == 1


@pytest.mark.parametrize("fingerprint", [5, "", "not hex!", "f" * 1000])
def test_a_malformed_request_fingerprint_is_refused_with_or_without_a_request_id(
    client, redis_client, queue, fingerprint
):
    """Without a request_id a fingerprint binds nothing, and a malformed one was taken silently;
    it is refused as with one, and nothing is enqueued."""
    for request_id in (None, f"r-{uuid.uuid4().hex[:8]}"):
        with pytest.raises(InvalidArgument, match="request_fingerprint: must be"):
            client.submit(prompt="x", max_tokens=2, request_id=request_id, request_fingerprint=fingerprint)
    assert redis_client.exists(KEYS.queue(queue)) == 0


def refused_forget(jobs, keys):
    """The clean-up's command, refused by Redis (as an ACL that grants no DEL would)."""
    return lambda pipe: pipe.execute_command("DEL")


def cut_forget(jobs, keys):
    """The clean-up's round trip, failed (the connection lost past the retries)."""

    def add(pipe):
        raise redis.ConnectionError("injected: the clean-up's connection is lost")

    return add


@pytest.mark.parametrize("failing_forget", [refused_forget, cut_forget], ids=["refused", "cut"])
def test_submit_many_raises_the_conflict_when_its_clean_up_fails_and_logs_the_clean_up(
    client, redis_client, queue, monkeypatch, caplog, failing_forget
):
    """As a single submit's refusal (steps.undoing): the user must learn that its request_id is
    another request's, whatever became of the hashes the call created before it found out."""
    taken = f"r-{uuid.uuid4().hex}"
    client.submit(prompt="first", request_id=taken)
    monkeypatch.setattr(bulk, "forget_commands", failing_forget)
    fresh = f"r-{uuid.uuid4().hex}"
    with pytest.raises(IdempotencyConflict) as e:
        client.submit_many([{"prompt": "new", "request_id": fresh}, {"prompt": "second", "request_id": taken}])
    assert e.value.request_id == taken
    (logged,) = [record.getMessage() for record in caplog.records if record.name == "producer_client.steps"]
    assert logged.startswith("the clean-up after IdempotencyConflict failed too: ")
    assert redis_client.xlen(KEYS.queue(queue)) == 1  # nothing of the chunk went in
