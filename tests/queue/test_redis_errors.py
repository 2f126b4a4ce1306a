"""Redis's refusals and absences reach the client's users as MILI's typed errors, each a kind of the
redis-py class it stands for: an ACL refusal (NOPERM) as PermissionDenied naming the command and
its key, refused credentials as CredentialsRefused, a server that refuses connections or does not
answer as RedisUnavailable (RedisTimedOut), naming the server and never the URL's password; `mili`
says each in one line. Against real redis-servers with docs/security.md's users."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import redis
import redis.exceptions

from cli.__main__ import main as mili
from harness.processes import REPO
from harness.redis_servers import RestartableRedis
from producer_client import AsyncClient, Client, MiliError, bulk, steps
from producer_client.connection import is_fatal, reply_code
from producer_client.errors import (
    CredentialsRefused,
    PermissionDenied,
    RedisOutOfMemory,
    RedisReadOnly,
    RedisTimedOut,
    RedisUnavailable,
)
from producer_client.keys import Keys
from producer_client.placement import prefix_key, rendezvous_score
from producer_client.schema import JobRequest
from tests.support.acl import acl_server
from worker.embedded_redis import EmbeddedRedis, free_port
from worker.loop.queue import is_transient

SECRET = "hunter2-not-shown"
KEYS = Keys()
T = TypeVar("T")
# Each way Redis refuses writes for now (maxmemory 1 with noeviction; a replica of a master that
# never answers), and how it takes them again.
WRITES_REFUSED = {
    "oom": (RedisOutOfMemory, lambda r: r.config_set("maxmemory", 1), lambda r: r.config_set("maxmemory", 0)),
    "readonly": (RedisReadOnly, lambda r: r.replicaof("127.0.0.1", free_port()), lambda r: r.replicaof("NO", "ONE")),
}

# Its tests of an unreachable or silent server wait out the client's tries (~13 s of its run): 0.9 s
# of CPU over its 16.7 s alone, at load 9: tests/support/tiers.py's `waits`.
pytestmark = pytest.mark.waits


@pytest.fixture(scope="module")
def acl():
    with acl_server() as server:
        yield server


def test_an_acl_refusal_is_permission_denied_naming_the_command_and_its_key(acl):
    """The producers' user may not read the dead letters (the workers' user's, docs/security.md)."""
    with Client(acl["producer"]) as client:
        with pytest.raises(PermissionDenied) as refused:
            client.dead_letters.list(5)
    error = refused.value
    assert isinstance(error, MiliError) and isinstance(error, redis.exceptions.NoPermissionError)
    assert is_fatal(error)  # the retry policy and the worker's start still see a refusal no retry mends
    assert error.code == "redis_refused"
    assert error.command == "XREVRANGE on 'mili:dead:{default}'"
    assert error.message == (
        "Redis refused XREVRANGE on 'mili:dead:{default}' to this client's user (NOPERM this user has no "
        "permissions to access one of the keys used as arguments): grant the user that right (docs/security.md)"
    )


@pytest.mark.parametrize(
    ("tenant", "request_id", "command"),
    [
        ("team-b", None, "HGETALL on 'mili:quota:team-b'"),  # its quota, read first
        ("team-a", "order-18", "a script (EVALSHA) on key 'mili:job:{order-18}'"),  # an id not its tenant's
    ],
    ids=["another-tenant", "another-tenants-id"],
)
def test_a_pinned_users_refusal_names_the_key_for_the_asyncio_client_too(acl, tenant, request_id, command):
    """docs/security.md's user pinned to team-a: a submit as team-b, or under an id outside team-a's
    (a job's keys begin with its tenant), is refused on the first key its rights do not cover."""

    async def submit() -> None:
        client = AsyncClient(acl["team-a"], tenant=tenant, placement=False)
        try:
            await client.submit(prompt="refused", max_tokens=8, request_id=request_id)
        finally:
            await client.aclose()

    with pytest.raises(PermissionDenied) as refused:
        asyncio.run(submit())
    assert refused.value.command == command
    assert refused.value.detail == "this user has no permissions to access one of the keys used as arguments"


def test_refused_credentials_are_credentials_refused_at_once_without_the_password(acl):
    url = acl["producer"].replace("producer-secret", SECRET)
    with Client(url) as client:
        with pytest.raises(CredentialsRefused) as refused:
            client.submit(prompt="hi", max_tokens=1)
    error = refused.value
    assert isinstance(error, redis.AuthenticationError) and is_fatal(error)
    assert error.code == "redis_refused"
    host_port = url.rpartition("@")[2].removesuffix("/0")
    assert error.message == (
        f"Redis at {host_port} refused this client's credentials: invalid username-password pair or user is "
        "disabled. (fix the URL's user or password)"
    )
    assert SECRET not in repr(error) and SECRET not in str(error.__cause__)


def test_a_refused_connection_is_redis_unavailable_naming_the_host_without_the_password():
    port = free_port()
    with Client(f"redis://someone:{SECRET}@127.0.0.1:{port}/0") as client:
        with pytest.raises(RedisUnavailable) as unavailable:
            client.submit(prompt="hi", max_tokens=1)  # after the call's tries (about 6 s)
    error = unavailable.value
    assert isinstance(error, redis.ConnectionError) and not is_fatal(error)
    assert error.code == "redis_unavailable"
    assert error.job_id is not None  # the submit's job, which the message names
    assert error.message == (
        f"Redis at 127.0.0.1:{port} is unavailable (a call on job {error.job_id!r}): ConnectionError: Error 111 "
        f"connecting to 127.0.0.1:{port}. Connection refused."
    )
    assert SECRET not in repr(error)


@pytest.mark.parametrize("refusal", list(WRITES_REFUSED))
def test_writes_redis_refuses_for_now_are_the_typed_error_naming_the_command(refusal):
    """Memory full under noeviction (OOM), a replica's copy (READONLY): a submit raised redis-py's
    raw error on main. Now it is RedisOutOfMemory (RedisReadOnly), a MiliError that names the
    command refused, still redis-py's class with its reply's first word, and an error the worker
    waits out (is_transient); code redis_unavailable: sending it again helps once Redis takes
    writes again."""
    kind, refuse, allow = WRITES_REFUSED[refusal]
    with EmbeddedRedis(port=free_port()) as server, redis.Redis.from_url(server.url) as admin:
        with Client(server.url, "q", placement=False) as client:
            refuse(admin)
            try:
                with pytest.raises(kind) as refused:
                    client.submit(prompt="hi", max_tokens=1, request_id="refused-1")
            finally:
                allow(admin)
    error = refused.value
    redis_class = redis.exceptions.OutOfMemoryError if refusal == "oom" else redis.exceptions.ReadOnlyError
    assert isinstance(error, MiliError) and isinstance(error, redis_class)
    assert (error.code, reply_code(error), is_transient(error)) == ("redis_unavailable", refusal.upper(), True)
    assert error.command == "a script (EVALSHA) on key 'mili:job:{refused-1}'"
    assert error.message == (
        f"Redis refused a script (EVALSHA) on key 'mili:job:{{refused-1}}' for now ({refusal.upper()} {error.detail}): try again "
        "once it takes writes"
    )


# Each call on one job, as the clients make it (`request_id`: a submit's job id is known to the caller).
ONE_JOB_CALLS = {
    "submit": lambda c, job_id: c.submit(prompt="hi", max_tokens=1, request_id=f"{job_id}-new"),
    "submit_rated": lambda c, job_id: c.submit_rated(prompt="hi", max_tokens=1, request_id=f"{job_id}-new"),
    "generate": lambda c, job_id: c.generate("hi", max_tokens=1, request_id=f"{job_id}-new", timeout=30),
    "status": lambda c, job_id: c.status(job_id),
    "result": lambda c, job_id: c.result(job_id, timeout=30),
    "wait": lambda c, job_id: c.wait(job_id, timeout=30),
    "cancel": lambda c, job_id: c.cancel(job_id),
    "stream": lambda c, job_id: list(c.stream(job_id, timeout=30)),
}


def test_redis_gone_under_a_call_on_one_job_is_redis_unavailable_naming_the_job():
    """A server that went away after the job was submitted: each call on one job, at once in threads
    (each spends its tries, about 6 s), raises RedisUnavailable whose job_id and message name the
    job it was about (a submit's: the one it submitted), caused by redis-py's error. On main none
    named its job: a caller with many jobs in flight could not tell which call failed."""
    server = EmbeddedRedis(port=free_port()).start()
    try:
        client = Client(server.url, "q", placement=False)
        job_id = client.submit(prompt="hi", max_tokens=1)
    finally:
        server.stop()
    with client, ThreadPoolExecutor(len(ONE_JOB_CALLS)) as pool:
        calls = {name: pool.submit(call, client, job_id) for name, call in ONE_JOB_CALLS.items()}
        errors = {name: call.exception(timeout=60) for name, call in calls.items()}
    for name, error in errors.items():
        about = f"{job_id}-new" if name.startswith(("submit", "generate")) else job_id
        assert isinstance(error, RedisUnavailable), (name, error)
        assert error.job_id == about, name
        assert error.message.startswith(
            f"Redis at 127.0.0.1:{server.port} is unavailable (a call on job {about!r}): ConnectionError: "
        ), (name, error.message)
        assert isinstance(error.__cause__, redis.ConnectionError) and not isinstance(error.__cause__, MiliError)


def test_redis_gone_under_the_asyncio_clients_call_on_one_job_names_the_job_too():
    server = EmbeddedRedis(port=free_port()).start()

    async def calls() -> list[BaseException | None]:
        client = AsyncClient(server.url, "q", placement=False)
        try:
            job_id = await client.submit(prompt="hi", max_tokens=1)
            server.stop()
            outcomes = await asyncio.gather(
                client.submit(prompt="hi", max_tokens=1, request_id=f"{job_id}-new"),
                client.result(job_id, timeout=30),
                client.cancel(job_id),
                return_exceptions=True,
            )
            return [job_id, *outcomes]
        finally:
            await client.aclose()

    try:
        job_id, *errors = asyncio.run(calls())
    finally:
        server.stop()
    assert [type(error) for error in errors] == [RedisUnavailable] * 3
    assert [error.job_id for error in errors] == [f"{job_id}-new", job_id, job_id]


def test_redis_gone_under_submit_many_is_redis_unavailable_naming_the_jobs_in_the_queue(monkeypatch):
    """Chunks of two jobs; the server goes away before the first chunk's `enqueued` flags are set
    (its jobs are in the queue): the RedisUnavailable that stops submit_many names those two as
    BulkQueueFull would. On main it named none (job_ids: no such attribute)."""
    server = EmbeddedRedis(port=free_port()).start()
    flags = bulk.flag_commands

    def server_gone(*args):
        server.stop()
        return flags(*args)

    monkeypatch.setattr(bulk, "CHUNK", 2)
    monkeypatch.setattr(bulk, "flag_commands", server_gone)
    ids = [f"gone-{i}" for i in range(4)]
    try:
        with Client(server.url, "q", placement=False) as client:
            with pytest.raises(RedisUnavailable) as unavailable:
                client.submit_many([{"prompt": job_id, "max_tokens": 1, "request_id": job_id} for job_id in ids])
    finally:
        server.stop()
    assert unavailable.value.job_ids == ids[:2]


@pytest.mark.parametrize(
    ("gone_at", "went_in"), [("xadds", slice(4, 5)), ("fallback", slice(2, 5))], ids=["placed xadds", "fallback"]
)
def test_redis_gone_under_submit_many_placed_jobs_is_redis_unavailable_naming_exactly_the_jobs_in(
    restartable_redis, monkeypatch, gone_at, went_in
):
    """Five jobs of one prompt on two workers of two slots each, as their heartbeats say: two placed
    on the first choice, two on the second, the fifth on the shared stream. The server stops once
    the lanes took theirs: before the placed XADDs (`xadds`), or before the fallback to the shared
    route of the first choice's jobs, whose stream a producer made a hash (`fallback`); it is back
    (its AOF kept) for the clean-up. RedisUnavailable names exactly the jobs in the queue, not a
    prefix; each has its hash and entry, and no job is left with a hash whose entry is not in.
    Passes since y/debts7's Missed; an enqueue_placed (or enqueue_elsewhere) that let the round
    trip's failure out, as before it, fails it: job_ids []."""
    queue, ids = "q", [f"gone-{i}" for i in range(5)]
    admin = redis.Redis.from_url(restartable_redis.url, decode_responses=True)
    for name in ("a", "b"):
        beat = {"name": name, "queue": queue, "state": "serving", "placement": 1, "lanes": 1, "slots": 2}
        admin.hset(KEYS.worker(name), mapping={**beat, "running": 0, "placed_held": 0})
        admin.zadd(KEYS.workers(queue), {name: time.time()})
    first = max(("a", "b"), key=lambda name: rendezvous_score(prefix_key(JobRequest(prompt="same prompt")), name))
    flags = bulk.flag_commands

    def back_for_the_clean_up(*args):
        restartable_redis.start()
        return flags(*args)

    with admin, Client(restartable_redis.url, queue) as client:
        client.placement.refresh_s = 3600
        steps.run(client.redis, client.placement.streams_for(KEYS, queue, []))  # the view it keeps
        if gone_at == "xadds":
            placed = bulk.enqueue_placed_commands
            monkeypatch.setattr(bulk, "enqueue_placed_commands", lambda *args: gone(restartable_redis, placed(*args)))
        else:
            admin.eval(
                "redis.call('DEL', KEYS[1]) return redis.call('HSET', KEYS[1], 'not', 'ours')",
                1,
                KEYS.own_queue(queue, first),
            )
            forget_view = client.placement.forget_view
            monkeypatch.setattr(client.placement, "forget_view", lambda q: gone(restartable_redis, forget_view(q)))
        monkeypatch.setattr(bulk, "flag_commands", back_for_the_clean_up)
        with pytest.raises(RedisUnavailable) as unavailable:
            client.submit_many([{"prompt": "same prompt", "max_tokens": 1, "request_id": i} for i in ids])
        assert unavailable.value.job_ids == ids[went_in]
        entries = {
            f["id"]
            for key in (KEYS.queue(queue), *(KEYS.own_queue(queue, name) for name in ("a", "b")))
            if admin.type(key) == "stream"
            for _, f in admin.xrange(key)
        }
        assert sorted(entries) == ids[went_in]
        assert [job_id for job_id in ids if admin.exists(KEYS.job(job_id))] == ids[went_in]


def gone(server: RestartableRedis, outcome: T) -> T:
    """`outcome`, once `server` has stopped."""
    server.stop()
    return outcome


def test_a_silent_server_is_redis_timed_out_for_the_asyncio_client_too():
    """A server that takes connections and answers nothing: each try's read times out."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]

        async def submit() -> None:
            client = AsyncClient(f"redis://127.0.0.1:{port}/0?socket_timeout=0.05&socket_connect_timeout=0.05")
            try:
                await client.submit(prompt="hi", max_tokens=1)
            finally:
                await client.aclose()

        with pytest.raises(RedisTimedOut) as timed_out:
            asyncio.run(submit())
    error = timed_out.value
    assert isinstance(error, redis.TimeoutError) and isinstance(error, redis.ConnectionError)
    assert isinstance(error, RedisUnavailable) and error.code == "redis_unavailable"
    assert error.message.startswith(
        f"Redis at 127.0.0.1:{port} is unavailable (a call on job {error.job_id!r}): TimeoutError: "
    ), error.message


def test_mili_says_an_acl_refusal_in_one_line_with_its_code(acl, capsys):
    assert mili(["--redis", acl["producer"], "dead", "list"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "error: redis_refused: Redis refused XREVRANGE on 'mili:dead:{default}' to this client's user (NOPERM this "
        "user has no permissions to access one of the keys used as arguments): grant the user that right "
        "(docs/security.md)\n"
    )


async def _asubmit(url: str, many: bool) -> None:
    client = AsyncClient(url, placement=False)
    try:
        if many:
            await client.submit_many([{"prompt": "refused", "max_tokens": 8}] * 2)
        else:
            await client.submit(prompt="refused", max_tokens=8)
    finally:
        await client.aclose()


def _submit(url: str, many: bool) -> None:
    with Client(url, placement=False) as client:
        if many:
            client.submit_many([{"prompt": "refused", "max_tokens": 8}] * 2)
        else:
            client.submit(prompt="refused", max_tokens=8)


@pytest.mark.parametrize("many", [False, True], ids=["submit", "submit_many"])
@pytest.mark.parametrize("use_asyncio", [False, True], ids=["sync", "asyncio"])
def test_a_submit_whose_create_the_acl_refuses_raises_that_refusal_and_cleans_up_nothing(
    acl, many, use_asyncio, caplog
):
    """docs/security.md's user pinned to team-a, submitting without a tenant: its jobs' keys are not
    team-a's, so Redis refuses the job's CREATE. The user sees the CREATE's refusal, the cause; the
    CREATE wrote nothing, so no clean-up is sent (its DEL, which the same ACL refused, was logged as
    a clean-up that failed: a second line on mili's stderr, tests/deploy/test_acl.py)."""
    with pytest.raises(PermissionDenied) as refused:
        if use_asyncio:
            asyncio.run(_asubmit(acl["team-a"], many))
        else:
            _submit(acl["team-a"], many)
    create = "a script (EVALSHA) on key 'mili:job:{" if many else "HSETNX on 'mili:job:{"
    assert refused.value.command.startswith(create), refused.value.command
    assert [record.getMessage() for record in caplog.records if record.name == "producer_client.steps"] == []


def run_mili(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )


def test_mili_says_refused_credentials_at_its_first_check_in_the_typed_line_without_the_password(acl):
    """`mili`'s first check (one try, before the command's calls) meets the wrong password first:
    it says it as the client's calls' CredentialsRefused reads, not as redis-py's error."""
    url = acl["producer"].replace("producer-secret", SECRET)
    host_port = url.rpartition("@")[2].removesuffix("/0")
    done = run_mili("--redis", url, "stats")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"error: redis_refused: Redis at {host_port} refused this client's credentials: invalid username-password "
        "pair or user is disabled. (fix the URL's user or password)\n"
    )


@pytest.fixture(scope="module")
def guarded():
    """A redis-server that wants a password (requirepass), with a user that may not PING: its
    address (host:port)."""
    with EmbeddedRedis(port=free_port()) as server:
        admin = redis.Redis.from_url(server.url)
        admin.execute_command("ACL", "SETUSER", "no-ping", "on", f">{SECRET}", "+@all", "-ping", "~*", "&*")
        admin.config_set("requirepass", SECRET)
        admin.close()
        yield server.url.removeprefix("redis://").removesuffix("/0")


def test_mili_says_a_missing_or_wrong_password_at_its_first_check_in_the_typed_line(guarded):
    """NOAUTH to a URL without a password names the cause, where Redis's reply speaks of HELLO."""
    done = run_mili("--redis", f"redis://{guarded}/0", "stats")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr.startswith(
        f"error: redis_refused: Redis at {guarded} refused this client's credentials: it wants a password and the "
        "URL gives none (HELLO must be called with the client already authenticated"
    ), done.stderr
    assert done.stderr.endswith(" (fix the URL's user or password)\n") and done.stderr.count("\n") == 1
    done = run_mili("--redis", f"redis://:wrong-{SECRET}@{guarded}/0", "stats")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"error: redis_refused: Redis at {guarded} refused this client's credentials: invalid username-password "
        "pair or user is disabled. (fix the URL's user or password)\n"
    )


def test_mili_says_a_user_refused_its_first_check_in_the_typed_permission_line(guarded):
    done = run_mili("--redis", f"redis://no-ping:{SECRET}@{guarded}/0", "stats")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        "error: redis_refused: Redis refused a new connection's first commands (its set-up and a PING) to this "
        "client's user (NOPERM this user has no permissions to run the 'ping' command): grant the user that right "
        "(docs/security.md)\n"
    )


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("redis+cluster://{}", "Cluster mode is not enabled on this node: for one server, use a redis:// URL"),
        ("redis://{}/99", "DB index is out of range"),
    ],
    ids=["cluster URL of one server", "database out of range"],
)
def test_mili_says_any_other_refusal_at_its_first_check_in_the_typed_line(redis_server, url, reason):
    host_port = redis_server.url.removeprefix("redis://").removesuffix("/0")
    done = run_mili("--redis", url.format(host_port), "stats")
    where = f"the cluster of {host_port}" if url.startswith("redis+cluster") else host_port
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == f"error: redis_refused: Redis at {where} refused this client: {reason}\n"


def test_mili_says_an_unreachable_redis_at_its_first_check_in_the_typed_line_without_the_password():
    port = free_port()
    done = run_mili("--redis", f"redis://someone:{SECRET}@127.0.0.1:{port}/0", "stats")
    assert (done.returncode, done.stdout) == (1, "")
    assert done.stderr == (
        f"error: redis_unavailable: Redis at 127.0.0.1:{port} is unavailable: ConnectionError: Error 111 connecting "
        f"to 127.0.0.1:{port}. Connection refused.\n"
    )
