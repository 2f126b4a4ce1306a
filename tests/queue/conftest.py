import uuid

import pytest

from tests.support.clients import make_client


@pytest.fixture
def queue():
    return f"q-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client(client_kind, redis_server, queue):
    c = make_client(client_kind, redis_server.url, queue)
    yield c
    c.close()
