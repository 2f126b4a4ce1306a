"""The embedded redis-server: private, reachable, gone after stop; a clear message without the binary."""

import pytest
import redis

from worker import embedded_redis
from worker.embedded_redis import EmbeddedRedis, RedisServerError


def test_it_serves_on_a_unix_socket_in_its_own_dir_and_cleans_up():
    server = EmbeddedRedis().start()
    directory = server.dir
    try:
        assert server.url == f"unix://{directory / 'redis.sock'}"
        client = redis.Redis.from_url(server.url)
        assert client.ping()
        client.close()
    finally:
        server.stop()
    assert not directory.exists()
    assert server.process is None


def test_a_missing_binary_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(embedded_redis.shutil, "which", lambda name, path=None: None)  # not on PATH, nor beside python
    with pytest.raises(RedisServerError) as e:
        EmbeddedRedis().start()
    assert "apt-get install redis-server" in e.value.message
