"""The ACL users of docs/security.md on a real redis-server, for the tests that act with only the
rights a role has (tests/deploy/test_acl.py, the hostile-producer tests): the `ACL SETUSER` lines
are read from docs/security.md, so the tests hold the docs to their word."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from worker.embedded_redis import EmbeddedRedis, free_port

SECURITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "security.md"
PASSWORDS = {
    "PRODUCER_PASSWORD": "producer-secret",
    "WORKER_PASSWORD": "worker-secret",
    "GATEWAY_PASSWORD": "gateway-secret",
    "TEAM_A_PASSWORD": "team-a-secret",
}


def acl_commands() -> list[list[str]]:
    lines = re.findall(r"^ACL SETUSER .+$", SECURITY_DOC.read_text(), flags=re.M)
    assert len(lines) == 4, lines
    for placeholder, password in PASSWORDS.items():
        lines = [line.replace(placeholder, password) for line in lines]
    return [shlex.split(line) for line in lines]


@contextmanager
def acl_server() -> Iterator[dict]:
    """A TCP redis-server with the documented users; the default user stays the admin. Yields the
    admin client and each role's URL (`team-a`: a producer pinned to tenant team-a)."""
    with EmbeddedRedis(port=free_port()) as server:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        for command in acl_commands():
            admin.execute_command(*command)
        base = server.url.removeprefix("redis://")
        try:
            yield {
                "admin": admin,
                "producer": f"redis://mili-producer:{PASSWORDS['PRODUCER_PASSWORD']}@{base}",
                "worker": f"redis://mili-worker:{PASSWORDS['WORKER_PASSWORD']}@{base}",
                "gateway": f"redis://mili-gateway:{PASSWORDS['GATEWAY_PASSWORD']}@{base}",
                "team-a": f"redis://mili-team-a:{PASSWORDS['TEAM_A_PASSWORD']}@{base}",
            }
        finally:
            admin.close()
