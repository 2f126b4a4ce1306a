"""The keys only workers write (docs/security.md: the producers' users may not), holding another
type after an operator's or a script's mistake: the dead-letter stream, the queue and worker indexes,
a worker's heartbeat. Each holds what a worker can write anew (letters that went with the DEL that
changed its type, names and times each heartbeat writes again), so none may stop a worker: on main
one DEADLETTER or heartbeat that met WRONGTYPE failed its exchange, which the worker retried with
backoff for ever, serving no job."""

from __future__ import annotations

import pytest
import redis

from harness.polling import eventually
from producer_client import Client, JobFailed
from producer_client.keys import GROUP, Keys
from tests.support.workers import FAST_RECLAIM, WorkerProcess

KEYS = Keys()
pytestmark = pytest.mark.waits
WORKER = "keys-worker"
MAX_DELIVERIES = 2


def ghost_deliveries(admin: redis.Redis, stream: str, count: int) -> list[str]:
    """The stream's first `count` entries read by a consumer that never ends them, each delivered
    MAX_DELIVERIES + 1 times (XCLAIM counts a delivery): the next worker to reclaim them finds
    them poison, and dead-letters them."""
    try:
        admin.xgroup_create(stream, GROUP, id="0", mkstream=True)
    except redis.ResponseError:  # BUSYGROUP: the worker made it
        pass
    [(_, entries)] = admin.xreadgroup(GROUP, "ghost", {stream: ">"}, count=count)
    ids = [entry_id for entry_id, _ in entries]
    for _ in range(MAX_DELIVERIES):
        admin.xclaim(stream, GROUP, "ghost", 0, ids)
    return ids


@pytest.mark.parametrize("place", ["shared stream", "own stream"])
def test_a_dead_letter_stream_of_another_type_is_made_anew_and_the_worker_serves_on(
    redis_server, redis_client, tmp_path, place
):
    queue = f"dead-{place.split()[0]}"
    worker = WorkerProcess(
        redis_server.url, queue, WORKER, tmp_path, *FAST_RECLAIM, "--max-deliveries", str(MAX_DELIVERIES), model="echo"
    )
    with Client(redis_server.url, queue, placement=False) as client:
        poison = [client.submit(prompt=f"poison {i}", max_tokens=4) for i in range(3)]
        stream = KEYS.queue(queue)
        if place == "own stream":  # moved, as placement puts them, onto the worker's own stream
            stream = KEYS.own_queue(queue, WORKER)
            for entry_id, fields in redis_client.xrange(KEYS.queue(queue)):
                redis_client.xadd(stream, fields)
                redis_client.xdel(KEYS.queue(queue), entry_id)
        ghost_deliveries(redis_client, stream, len(poison))
        redis_client.set(KEYS.dead(queue), "an operator's mistake")
        worker.start().wait_ready()
        try:
            for job in poison:
                with pytest.raises(JobFailed) as failed:
                    client.result(job, timeout=30)
                assert failed.value.code == "poison"
            good = [client.submit(prompt=f"good {i}", max_tokens=8) for i in range(5)]
            assert [client.result(job, timeout=30).text for job in good] == [f"good {i}" for i in range(5)]
            assert eventually(lambda: redis_client.xpending(stream, GROUP)["pending"] == 0)
            letters = redis_client.xrange(KEYS.dead(queue))
            assert sorted(fields["id"] for _, fields in letters) == sorted(poison)
            assert worker.running and "Traceback" not in worker.log(), worker.log()
        finally:
            worker.stop()


@pytest.mark.parametrize("index", ["queue index", "worker index", "heartbeat"])
def test_a_registry_key_of_another_type_is_made_anew_and_the_worker_serves_on(
    redis_server, redis_client, tmp_path, index
):
    """The queue index, the queue's worker index or the worker's heartbeat hash made a string while
    the worker serves: its next heartbeat deletes it and writes it anew, jobs submitted meanwhile and
    after are served, and the key holds its type again, the worker's heartbeat with it."""
    queue = f"registry-{index.split()[0]}"
    key, kind = {
        "queue index": (KEYS.queues(), "zset"),
        "worker index": (KEYS.workers(queue), "zset"),
        "heartbeat": (KEYS.worker(WORKER), "hash"),
    }[index]
    worker = WorkerProcess(redis_server.url, queue, WORKER, tmp_path, *FAST_RECLAIM, model="echo")
    worker.start().wait_ready()
    try:
        with Client(redis_server.url, queue, placement=False) as client:
            for round_ in range(3):  # past several heartbeats each time
                redis_client.delete(key)
                redis_client.set(key, "an operator's mistake")
                jobs = [client.submit(prompt=f"round {round_} job {i}", max_tokens=16) for i in range(4)]
                assert [client.result(job, timeout=30).text for job in jobs] == [
                    f"round {round_} job {i}" for i in range(4)
                ]
                assert eventually(lambda: redis_client.type(key) == kind and worker.ready())
        assert worker.running and "Traceback" not in worker.log(), worker.log()
    finally:
        worker.stop()
