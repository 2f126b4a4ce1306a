"""The README's ACL split, run as written against a real redis-server: a producer user can do
everything the client does and nothing a worker does; a worker user can run the queue loop
and the healthcheck, and nothing outside the `mili:` prefix."""
from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest
import redis

from producer_client import Client
from producer_client.keys import GROUP, Keys
from tests.deploy.support import ROOT, environment_without_mili, wait_for
from tests.redis_support import free_port
from worker.embedded_redis import EmbeddedRedis
from worker.healthcheck import healthcheck
from worker.settings import WorkerSettings

PASSWORDS = {"PRODUCER_PASSWORD": "producer-secret", "WORKER_PASSWORD": "worker-secret"}


def acl_commands() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    lines = re.findall(r"^ACL SETUSER .+$", text, flags=re.M)
    assert len(lines) == 2, lines
    for placeholder, password in PASSWORDS.items():
        lines = [line.replace(placeholder, password) for line in lines]
    return [shlex.split(line) for line in lines]



@pytest.fixture
def acl_redis():
    """A TCP redis-server with the two users of the README; the default user stays the admin."""
    with EmbeddedRedis(port=free_port()) as server:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        for command in acl_commands():
            admin.execute_command(*command)
        base = server.url.removeprefix("redis://")
        yield {
            "admin": admin,
            "producer": f"redis://mili-producer:{PASSWORDS['PRODUCER_PASSWORD']}@{base}",
            "worker": f"redis://mili-worker:{PASSWORDS['WORKER_PASSWORD']}@{base}",
        }
        admin.close()


@pytest.fixture
def acl_worker(acl_redis):
    process = subprocess.Popen(
        [sys.executable, "-m", "worker", "serve", "--model", "echo", "--redis", acl_redis["worker"],
         "--name", "acl-worker", "--metrics-host", "127.0.0.1", "--metrics-port", "0"],
        cwd=ROOT, env=environment_without_mili(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
    )
    wait_for(lambda: acl_redis["admin"].exists(Keys().worker("acl-worker")) or process.poll() is not None, 60,
             "the worker's heartbeat")
    assert process.poll() is None, f"the worker exited with {process.returncode} under the worker ACL"
    yield process
    process.kill()
    process.wait()


def test_the_producer_user_can_do_what_the_client_does(acl_redis, acl_worker):
    with Client(acl_redis["producer"]) as client:
        job = client.submit(prompt="hello acl", max_tokens=32)
        assert client.result(job, timeout=30).text == "hello acl"
        assert "".join(delta.text for delta in client.stream(job)) == "hello acl"
        assert client.status(job).status == "done"
        client.cancel(job)  # of a finished job: runs the cancel script, changes nothing
        assert client.queue_stats().workers == ["acl-worker"]
        first = client.submit(prompt="once", max_tokens=8, request_id="acl-request")  # HSETNX path
        assert client.submit(prompt="once", max_tokens=8, request_id="acl-request") == first
        assert client.result(first, timeout=30).text == "once"


def test_the_producer_user_cannot_act_as_a_worker(acl_redis, acl_worker):
    producer = redis.Redis.from_url(acl_redis["producer"], decode_responses=True)
    stream = Keys().queue("default")
    entry = producer.xadd(stream, {"id": "raw", "v": "1", "body": "{}"})
    forbidden = [
        lambda: producer.xreadgroup(GROUP, "intruder", {stream: ">"}, count=1),
        lambda: producer.xack(stream, GROUP, entry),
        lambda: producer.xdel(stream, entry),
        lambda: producer.xgroup_destroy(stream, GROUP),
        lambda: producer.hset(Keys().worker("acl-worker"), "state", "fake"),
        lambda: producer.expire(Keys().job("raw"), 1),
        lambda: producer.get("not-mili"),
        lambda: producer.flushall(),
    ]
    for command in forbidden:
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    producer.close()


def test_the_worker_user_runs_the_healthcheck_and_stays_in_its_prefix(acl_redis, acl_worker):
    assert healthcheck(WorkerSettings(redis=acl_redis["worker"], name="acl-worker")) == 0
    worker = redis.Redis.from_url(acl_redis["worker"], decode_responses=True)
    for command in (lambda: worker.set("not-mili", 1), lambda: worker.flushall(), lambda: worker.config_get("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    worker.close()
