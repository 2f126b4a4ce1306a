import uuid

import pytest

from tests.redis_support import (  # noqa: F401  (fixtures)
    client_kind, make_client, redis_client, redis_client_of, redis_server, restartable_redis,
)


@pytest.fixture
def queue():
    return f"q-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(client_kind, redis_server, queue):  # noqa: F811  (the imported fixtures)
    c = make_client(client_kind, redis_server.url, queue)
    yield c
    c.close()
