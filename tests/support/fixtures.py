"""The fixtures every test package may use, loaded for the whole run by tests/conftest.py
(`pytest_plugins`): a real redis-server on a free port, a Redis Cluster and a Sentinel setup,
`redis_deployment` to run a test on each of the three, clients of them, and `client_kind` to
run a test body with the sync and the async client."""

from __future__ import annotations

import pytest
import redis

from harness.redis_servers import LocalCluster, LocalSentinel, RestartableRedis
from producer_client.connection import connect
from worker.embedded_redis import EmbeddedRedis, free_port

MODES = {"server": "redis_server", "cluster": "redis_cluster", "sentinel": "redis_sentinel"}


def on_modes(*modes: str):
    """Runs a test that uses redis_deployment on `modes` only (their instances are the session's,
    shared with the tests that run on all three): what does not depend on the mode runs on one
    server alone, to keep the suite quick."""
    return pytest.mark.parametrize("redis_deployment", list(modes), indirect=True)


SERVER_ONLY = on_modes("server")


@pytest.fixture(scope="session")
def redis_server():
    with EmbeddedRedis(port=free_port()) as server:
        yield server


@pytest.fixture
def redis_client(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    with LocalCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_sentinel(tmp_path_factory):
    with LocalSentinel(tmp_path_factory.mktemp("sentinel")) as setup:
        yield setup


@pytest.fixture(scope="session", params=list(MODES))
def redis_deployment(request):
    """Each of the three modes in turn, one instance of each per session: its `url`."""
    return request.getfixturevalue(MODES[request.param])


@pytest.fixture
def deployment_client(redis_deployment):
    """A client of the deployment in its mode, for what a test reads and checks."""
    client = connect(redis_deployment.url, decode_responses=True)
    yield client
    client.close()


@pytest.fixture(params=["sync", "async"])
def client_kind(request) -> str:
    return request.param


@pytest.fixture
def restartable_redis(tmp_path):
    server = RestartableRedis(tmp_path).start()
    yield server
    server.stop()


@pytest.fixture
def redis_client_of():
    """redis_client_of(server): a client of that server, closed after the test."""
    clients = []

    def connect_to(server) -> redis.Redis:
        clients.append(redis.Redis.from_url(server.url, decode_responses=True))
        return clients[-1]

    yield connect_to
    for c in clients:
        c.close()
