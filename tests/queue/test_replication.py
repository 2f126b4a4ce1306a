"""wait_replicas: a submit returns, and a worker acknowledges a job's entry, only once that many
replicas have what was written (WAIT); fewer in wait_timeout_ms make a submit raise
NotReplicated (the job is enqueued all the same) and keep a worker's entry pending until they
have it. On one server with a replica started beside it, and with each of the two distributed
modes' replicas read directly."""

from __future__ import annotations

import pytest

from harness.echo_workers import serving
from harness.polling import eventually
from harness.redis_servers import ServerProcess
from producer_client import AsyncClient, Client
from producer_client.errors import InvalidArgument, NotReplicated
from producer_client.keys import GROUP, Keys
from tests.support.clients import make_client

# Its tests wait on replicas (WAIT, its timeouts, a replica started beside the server, a Sentinel's
# and a Cluster's): 1.2 s of CPU over its 7.4 s alone: tests/support/tiers.py's `waits`.
pytestmark = pytest.mark.waits

KEYS = Keys()
WAIT_TIMEOUT_MS = 50


def test_a_submit_no_replica_confirms_raises_not_replicated_and_the_job_stays_enqueued(
    client_kind, redis_server, redis_client, queue
):
    client = make_client(client_kind, redis_server.url, queue, wait_replicas=1, wait_timeout_ms=WAIT_TIMEOUT_MS)
    try:
        with pytest.raises(NotReplicated) as raised:
            client.submit("unconfirmed", max_tokens=4, request_id=f"{queue}-job")
    finally:
        client.close()
    assert (raised.value.code, raised.value.job_id, raised.value.confirmed, raised.value.replicas) == (
        "not_replicated",
        f"{queue}-job",
        0,
        1,
    )
    assert redis_client.hget(KEYS.job(f"{queue}-job"), "status") == "queued"
    assert [f["id"] for _, f in redis_client.xrange(KEYS.queue(queue))] == [f"{queue}-job"]


@pytest.mark.parametrize(
    "setting, field", [({"wait_replicas": -1}, "wait_replicas"), ({"wait_timeout_ms": 0}, "wait_timeout_ms")]
)
def test_a_bad_wait_setting_is_refused_before_anything_is_sent(setting, field):
    with pytest.raises(InvalidArgument) as raised:
        Client("redis://127.0.0.1:1/0", **setting)
    assert raised.value.field == field


@pytest.mark.parametrize("make", [Client, AsyncClient])
def test_a_wait_as_long_as_the_socket_timeout_is_refused_before_anything_connects(make):
    """A WAIT of wait_timeout_ms at or past the connection's socket timeout (redis-py's 5 s where the
    URL sets none) was read after the client had stopped reading: the retry policy sent the enqueue
    again up to ten times and the submit raised RedisTimedOut after ~59 s, never NotReplicated
    (y/flake4). Refused at construction, naming the field; a URL's longer socket_timeout admits it."""
    for url, wait_ms in [("redis://127.0.0.1:1/0", 5000), ("redis://127.0.0.1:1/0?socket_timeout=2", 2000)]:
        with pytest.raises(InvalidArgument) as raised:
            make(url, wait_replicas=1, wait_timeout_ms=wait_ms)
        assert raised.value.field == "wait_timeout_ms" and "socket_timeout" in str(raised.value)
    for url, replicas in [("redis://127.0.0.1:1/0?socket_timeout=10", 1), ("redis://127.0.0.1:1/0", 0)]:
        with Client(url, wait_replicas=replicas, wait_timeout_ms=5000):  # the longer socket timeout; no WAIT
            pass


def test_under_sentinel_a_confirmed_submit_is_on_the_replica(redis_sentinel, queue):
    with Client(redis_sentinel.url, queue, wait_replicas=1, wait_timeout_ms=4000) as client:
        job_id = client.submit("confirmed", max_tokens=4)
    master = redis_sentinel.current_master()
    replica = redis_sentinel.replica if master is redis_sentinel.master else redis_sentinel.master
    with replica.client() as c:  # read at once: WAIT vouched for it
        assert c.hget(KEYS.job(job_id), "status") == "queued"
        assert [f["id"] for _, f in c.xrange(KEYS.queue(queue))] == [job_id]


def test_on_a_cluster_a_confirmed_submit_is_on_the_replicas_of_the_jobs_and_the_queues_masters(redis_cluster, queue):
    with Client(redis_cluster.url, queue, wait_replicas=1, wait_timeout_ms=4000) as client:
        ids = [client.submit(f"confirmed {i}", max_tokens=4) for i in range(6)]
    for key, wanted in [*((KEYS.job(job_id), "queued") for job_id in ids), (KEYS.queue(queue), len(ids))]:
        with redis_cluster.replica_of(redis_cluster.master_of(key)).client() as c:
            c.execute_command("READONLY")  # a cluster replica answers reads of its master's slots
            found = c.xlen(key) if wanted == len(ids) else c.hget(key, "status")
        assert found == wanted, key


def test_a_worker_acknowledges_a_result_only_once_a_replica_has_it(tmp_path, queue):
    master = ServerProcess(tmp_path / "master").start()
    replica = ServerProcess(tmp_path / "replica")
    url = f"redis://127.0.0.1:{master.port}/0"
    try:
        with (
            serving(url, queue, wait_replicas=1, wait_timeout_ms=WAIT_TIMEOUT_MS, claim_idle_ms=2000),
            Client(url, queue) as client,
            master.client() as admin,
        ):
            job_id = client.submit("waits for a replica", max_tokens=5)
            assert client.result(job_id, timeout=10).text == "waits"  # written, and read at once
            # No replica has it: the entry stays, for as long as several WAITs.
            assert not eventually(lambda: admin.xlen(KEYS.queue(queue)) == 0, timeout=20 * WAIT_TIMEOUT_MS / 1000)
            assert admin.xpending(KEYS.queue(queue), GROUP)["pending"] == 1
            replica.start("--replicaof", "127.0.0.1", str(master.port))
            assert eventually(lambda: admin.xlen(KEYS.queue(queue)) == 0, timeout=30)
            assert admin.xpending(KEYS.queue(queue), GROUP)["pending"] == 0
            with replica.client() as c:
                assert c.hget(KEYS.job(job_id), "status") == "done"
    finally:
        replica.stop()
        master.stop()
