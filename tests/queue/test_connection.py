"""Redis URLs of the three modes, checked before anything connects, and the clients made from them.
No server runs here except where a test says so: a bad URL must fail on its own, in one line."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
from urllib.parse import quote

import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.retry
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import ConstantBackoff, NoBackoff

from harness.processes import REPO
from producer_client import AsyncClient, Client, InvalidArgument, steps
from producer_client.cluster import Cluster, NotACluster, known_keys
from producer_client.connection import Mode, connect, connect_async, parse_url, redact_url, server_of, server_of_url
from producer_client.errors import RedisRefused, RedisUnavailable
from producer_client.protocol import execution
from worker.__main__ import wait_for_redis
from worker.embedded_redis import EmbeddedRedis, free_port

# Its reconnection tests wait out retry back-offs and a failover (1.6 s of CPU over its 5.9 s run alone, at load 5):
# tests/support/tiers.py's `waits`.
pytestmark = pytest.mark.waits

SECRET = "pa55-w0rd"

GOOD = [
    ("redis://localhost:6379/0", Mode.SERVER, (), "", {}),
    (
        "rediss://u:p@h:1/2?socket_timeout=3",
        Mode.SERVER,
        (),
        "",
        {"socket_timeout": 3.0, "username": "u", "password": "p"},
    ),
    ("unix:///tmp/redis.sock", Mode.SERVER, (), "", {"path": "/tmp/redis.sock"}),
    ("unix:///r.sock?db=1&max_connections=5", Mode.SERVER, (), "", {"path": "/r.sock", "db": 1, "max_connections": 5}),
    ("rediss://h/0?ssl_check_hostname=false", Mode.SERVER, (), "", {"ssl_check_hostname": False}),
    ("redis+cluster://10.0.0.1:7000", Mode.CLUSTER, (("10.0.0.1", 7000),), "", {}),
    (
        "redis+cluster://u:p%40ss@a:7000,b:7001,[::1]:7002/",
        Mode.CLUSTER,
        (("a", 7000), ("b", 7001), ("::1", 7002)),
        "",
        {"username": "u", "password": "p@ss"},
    ),
    (
        "rediss+cluster://a,b?ssl_cert_reqs=none",
        Mode.CLUSTER,
        (("a", 6379), ("b", 6379)),
        "",
        {"ssl": True, "ssl_cert_reqs": "none"},
    ),
    ("redis+sentinel://s1:26379,s2:26380/mymaster", Mode.SENTINEL, (("s1", 26379), ("s2", 26380)), "mymaster", {}),
    (
        "rediss+sentinel://:pw@s1/mymaster?db=3",
        Mode.SENTINEL,
        (("s1", 26379),),
        "mymaster",
        {"password": "pw", "db": 3, "ssl": True},
    ),
]


@pytest.mark.parametrize("url, mode, nodes, service, options", GOOD, ids=[g[0] for g in GOOD])
def test_a_url_names_its_mode_nodes_service_and_options(url, mode, nodes, service, options):
    parsed = parse_url(url)
    assert (parsed.mode, parsed.nodes, parsed.service) == (mode, nodes, service)
    assert options.items() <= parsed.options.items()


BAD = [
    ("http://h:6379", "unknown scheme"),
    ("localhost:6379", "unknown scheme"),
    ("redis+clustr://h:7000", "unknown scheme"),
    ("redis://h:port", "Port could not be cast"),
    ("redis+cluster://", "'' is not host:port"),
    ("redis+cluster://a:7000,,b:7001", "'' is not host:port"),
    ("redis+cluster://a:70000", "port 70000 is out of range"),
    ("redis+cluster://a:7000/1", "database 0 only"),
    ("redis+cluster://a:7000?db=2", "database 0 only"),
    ("redis+cluster://a:7000?socket_timeout=soon", "Invalid value for 'socket_timeout'"),
    ("redis+sentinel://s1:26379", "name the master's service"),
    ("redis+sentinel://s1:26379/", "name the master's service"),
    ("redis+sentinel://s1:26379/a/b", "name the master's service"),
    (f"redis+sentinel://user:{SECRET}@s1:x/m", "'s1:x' is not host:port"),
    # An option the connection does not take, which redis-py would pass on to it (a TypeError at
    # the first command); not named, as it may be part of a password with a raw &.
    ("redis://h:1/0?fo0=bar", "none of redis-py's for a TCP connection"),
    ("redis://h:1/0?ssl_cert_reqs=none", "none of redis-py's for a TCP connection"),
    ("redis+cluster://a:7000?timeout=3", "none of redis-py's for a TCP connection"),
    ("redis+sentinel://s1/m?decode_responses=true", "none of redis-py's for a TCP connection"),
    ("rediss+sentinel://s1/m?parser_class=x", "none of redis-py's for a TLS connection (rediss://)"),
    ("unix:///tmp/r.sock?socket_keepalive=true", "none of redis-py's for a unix socket"),
    (f"redis://h:1/0?password=a&{SECRET}=b", "none of redis-py's for a TCP connection"),
    # No host: redis-py connects to localhost:6379, the URL's credentials and all, where an empty
    # ${REDIS_HOST} meant some other server; errors then named the server `?:?`.
    (f"redis://u:{SECRET}@/0", "name the server's host: redis://host:6379/0"),
    (f"rediss://:{SECRET}@", "name the server's host"),
    ("redis:///0", "name the server's host"),
    ("redis://", "name the server's host"),
    ("redis://:6380/0", "name the server's host"),
    (f"unix://u:{SECRET}@", "name the socket's path: unix:///path/to/redis.sock"),
    ("unix://", "name the socket's path"),
    # A path that is no database number: redis-py took /abc for database 0 and /1/2 for 12.
    ("redis://h:1/abc", "its path must be a database number"),
    ("redis://h:1/1/2", "its path must be a database number"),
    (f"rediss://u:{SECRET}@h:1/0x", "its path must be a database number"),
    # Numbers out of their range, which redis-py passed on: a negative timeout was a ValueError
    # (a traceback) at the first command, a timeout of 0 a connect that never succeeds.
    ("redis://h:1/0?socket_timeout=-1", "its option socket_timeout must be a number of seconds above 0"),
    ("redis://h:1/0?socket_connect_timeout=0", "its option socket_connect_timeout must be a number of seconds"),
    ("redis://h:1/0?socket_timeout=nan", "its option socket_timeout must be a number of seconds"),
    ("redis://h:1/0?socket_timeout=inf", "its option socket_timeout must be a number of seconds"),
    ("redis://h:1/0?health_check_interval=-5", "its option health_check_interval must be a whole number"),
    ("redis://h:1/0?max_connections=0", "its option max_connections must be a whole number from 1"),
    ("redis://h:1/0?socket_read_size=0", "its option socket_read_size must be"),
    ("redis://h:1?db=-1", "its option db must be a database number"),
    ("redis://h:1/0?protocol=5", "its option protocol must be 2 or 3"),
    ("unix:///tmp/r.sock?socket_timeout=-2", "its option socket_timeout must be"),
    ("redis+cluster://a:7000?socket_timeout=0", "its option socket_timeout must be"),
    ("redis+sentinel://s1/m?socket_connect_timeout=-1", "its option socket_connect_timeout must be"),
]


@pytest.mark.parametrize("url, reason", BAD, ids=[b[0] for b in BAD])
def test_a_bad_url_is_one_invalid_argument_naming_redis_without_the_password(url, reason):
    with pytest.raises(InvalidArgument) as e:
        parse_url(url)
    assert e.value.field == "redis" and reason in e.value.message
    assert SECRET not in e.value.message and "\n" not in e.value.message and "fo0" not in e.value.message


@pytest.mark.parametrize(
    "url, server",
    [
        ("redis://localhost", "localhost:6379"),
        (f"rediss://u:{SECRET}@cache.internal/1", "cache.internal:6379"),
        ("redis://h:6380/0", "h:6380"),
        ("unix:///tmp/r.sock", "unix:/tmp/r.sock"),
    ],
)
def test_a_server_url_names_its_server_with_redis_pys_default_port(url, server):
    """An error names the server a client talks to: a URL without a port said `localhost:?`."""
    assert server_of_url(parse_url(url)) == server
    assert server_of(connect(url)) == server


def test_a_url_that_is_not_a_string_is_refused():
    with pytest.raises(InvalidArgument, match="redis: must be a URL"):
        parse_url(None)


# Passwords as users type them: reserved characters, percent-escapes, colons. The prefix keeps a
# short password from matching text that is not its own by chance ("6379", "redis").
PASSWORD_CHARS = "abcXYZ0189/@#:%?&=+!$~'*;,[]"
passwords = st.text(PASSWORD_CHARS, min_size=3, max_size=24).map(lambda rest: "Zq" + rest)
URL_FORMS = [
    "redis://user:{}@h:6379/0",
    "redis://:{}@h:6379/0",
    "redis://{}@h:6379/0",
    "rediss://mili-worker:{}@h/1",
    "redis+cluster://user:{}@a:7000,b:7001",
    "rediss+cluster://:{}@a",
    "redis+sentinel://user:{}@s1:1,s2:2,s3:3/mymaster",
    "rediss+sentinel://{}@s1,s2/m",
    "redis://h:6379/0?socket_timeout=5&password={}",
    "unix://user:{}@/tmp/r.sock?db=1",
]


def shown(url: str) -> str:
    """Everything a program may say about `url`: its redacted form, and what parsing it says."""
    try:
        return f"{redact_url(url)} {parse_url(url)}"
    except InvalidArgument as e:
        return f"{redact_url(url)} {e.message}"


@settings(max_examples=400, deadline=None)
@given(password=passwords, form=st.sampled_from(URL_FORMS), encoded=st.booleans())
def test_no_password_shows_whatever_its_characters_and_the_urls_form(password, form, encoded):
    url = form.format(quote(password, safe="") if encoded else password)
    text = shown(url)
    assert password not in text and quote(password, safe="") not in text, (url, text)
    assert "Zq" not in text, (url, text)  # no part of it either


@settings(max_examples=200, deadline=None)
@given(text=st.text(min_size=1, max_size=40))
def test_text_that_is_no_redis_url_shows_none_of_itself(text):
    if "://" in text and text.partition("://")[0].lower() in ("redis", "rediss", "unix") or "+" in text:
        return
    assert text not in redact_url(text) or text in "<not a Redis URL>"
    with pytest.raises(InvalidArgument) as e:
        parse_url(text)
    assert "<not a Redis URL>" in e.value.message


def test_a_url_that_splits_elsewhere_than_meant_is_refused_without_any_of_its_credentials():
    for url in (
        "redis://Ux7:1#2@h:6379/0",
        "redis://Ux7:a/b@h/0",
        "redis://Ux7:a?b@h/0",
        "redis+cluster://Ux7:s/cr@a,b",
    ):
        with pytest.raises(InvalidArgument) as e:
            parse_url(url)
        assert "percent-encode" in e.value.message and "://***@" in e.value.message and "Ux7" not in e.value.message


def test_redis_py_options_show_and_the_rest_is_hidden():
    assert redact_url("redis://mili-worker:pw@h:1/0?socket_timeout=5&password=x&ssl_cert_reqs=none") == (
        "redis://***@h:1/0?socket_timeout=5&ssl_cert_reqs=none&***"
    )


def test_every_mode_redacts_the_password():
    for url in (
        f"redis://u:{SECRET}@h:1/0",
        f"redis+cluster://u:{SECRET}@a:1,b:2",
        f"rediss+sentinel://:{SECRET}@s:1/m",
    ):
        assert SECRET not in redact_url(url) and "***" in redact_url(url)
        assert str(parse_url(url)) == redact_url(url)


@pytest.mark.parametrize("make", [Client, AsyncClient], ids=["Client", "AsyncClient"])
def test_the_clients_refuse_a_bad_url_before_connecting(make):
    with pytest.raises(InvalidArgument, match="redis: redis\\+cluster://a:1/7: a cluster has database 0 only"):
        make("redis+cluster://a:1/7")


def test_the_cli_says_a_bad_url_in_one_line_and_exits_1():
    done = subprocess.run(
        [sys.executable, "-m", "cli", "--redis", f"redis+sentinel://u:{SECRET}@s1:26379", "stats"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "error: invalid_argument: redis: redis+sentinel://***@s1:26379: name the master's service after the "
        "sentinels: redis+sentinel://host:26379/mymaster"
    )


async def test_a_cluster_url_naming_one_server_is_one_fatal_error_at_once_to_every_program(redis_server):
    """redis+cluster:// of a server whose cluster mode is off: redis-py raised RedisClusterException,
    which is no RedisError, so the CLI and the worker printed a traceback. Now NotACluster, at once
    (no retry makes a server a cluster): the CLI says it in one line, the worker stops with
    redis_refused before it loads a model."""
    url = redis_server.url.replace("redis://", "redis+cluster://").removesuffix("/0")
    with pytest.raises(NotACluster, match="use a redis:// URL"):
        Client(url).submit(prompt="a")
    client = AsyncClient(url)
    with pytest.raises(NotACluster, match="use a redis:// URL"):
        await client.submit(prompt="a")
    with pytest.raises(RedisRefused, match="NotACluster: Cluster mode is not enabled on this node"):
        wait_for_redis(url, backoff_max_s=0.1)
    done = subprocess.run(
        [sys.executable, "-m", "cli", "--redis", url, "stats"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr == (
        f"error: redis_refused: Redis at the cluster of {url.removeprefix('redis+cluster://')} refused this client: "
        "Cluster mode is not enabled on this node: for one server, use a redis:// URL\n"
    )


@pytest.fixture
def http_port():
    """A port where an HTTP server answers (the gateway's port given for Redis's): what it reads, it
    answers with a 400 and closes."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            with connection:
                connection.settimeout(5)
                try:
                    connection.recv(65536)
                    connection.sendall(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


def test_a_server_that_is_not_redis_is_one_line_at_once_to_the_cli_and_the_worker(http_port):
    """A URL naming a port where another server answers (an HTTP server's): redis-py's
    InvalidResponse, no RedisError that the CLI or the worker typed, so the CLI said it with no code
    and the worker stopped with a traceback. Now redis_unavailable, saying so, at once (no retry
    makes the server Redis), without the URL's password."""
    url = f"redis://u:{SECRET}@127.0.0.1:{http_port}/0"
    cause = "the server there answers as no Redis server does (InvalidResponse: "
    with pytest.raises(RedisUnavailable, match=re.escape(cause)):
        wait_for_redis(url, backoff_max_s=0.1)
    done = subprocess.run(
        [sys.executable, "-m", "cli", "--redis", url, "stats"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1
    assert done.stderr.startswith(f"error: redis_unavailable: Redis at 127.0.0.1:{http_port} is unavailable: {cause}")
    assert done.stderr.endswith("): is this Redis's address and port?\n") and done.stderr.count("\n") == 1
    worker = subprocess.run(
        [sys.executable, "-m", "worker", "--model", "echo", "--redis", url, "--metrics-port", "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert worker.returncode == 2, worker.stderr
    assert worker.stderr.splitlines()[-1].startswith(
        f"error: redis_unavailable: Redis at redis://***@127.0.0.1:{http_port}/0 is unavailable: {cause}"
    )
    assert "Traceback" not in worker.stderr and SECRET not in worker.stderr + done.stderr


def test_asyncio_clients_connect_at_their_first_command():
    assert isinstance(connect_async("redis+cluster://127.0.0.1:1"), AsyncRedisCluster)
    assert isinstance(connect_async("redis+sentinel://127.0.0.1:1/m"), redis.asyncio.Redis)
    assert isinstance(connect(f"redis+sentinel://127.0.0.1:{free_port()}/m"), redis.Redis)


def test_a_cluster_that_no_node_answers_raises_a_connection_error():
    # redis-py raises RedisClusterException, which is no RedisError: callers would not see an outage.
    with pytest.raises(redis.ConnectionError):
        connect(f"redis+cluster://127.0.0.1:{free_port()}")


@pytest.mark.parametrize(
    "args, keys",
    [
        (("EVALSHA", "abc", 2, "k1", "k2", "arg"), ["k1", "k2"]),
        (("EVAL", "return 1", 0), None),
        (("XREADGROUP", b"GROUP", "g", "c", b"COUNT", "2", b"BLOCK", "5", b"STREAMS", "s", ">"), ["s"]),
        (("XREAD", b"COUNT", "1", b"STREAMS", "a", "b", "0-0", "0-0"), ["a", "b"]),
        (("HGETALL", "h"), None),
    ],
)
def test_script_calls_and_stream_reads_route_by_their_own_keys(args, keys):
    assert known_keys(args) == keys


class NodeDownCluster(Cluster):
    """A cluster client whose pipelines find a node down for their first `down_for` tries: each
    command's reply is the node's ConnectionError, as redis-py gives it once its own immediate
    tries are spent. No topology is read: nothing is sent."""

    def __init__(self, down_for: int):
        self.pacing = redis.retry.Retry(NoBackoff(), 5, supported_errors=(redis.ConnectionError,))
        self.down_for = down_for
        self.tries = 0

    def pipeline(self, transaction: bool = False):
        return NodeDownPipeline(self)


class NodeDownPipeline:
    def __init__(self, cluster: NodeDownCluster):
        self.cluster = cluster
        self.commands = []

    def execute_command(self, *args, **options):
        self.commands.append(args)

    def execute(self, raise_on_error: bool = True) -> list:
        self.cluster.tries += 1
        if self.cluster.tries <= self.cluster.down_for:
            return [redis.ConnectionError("node down") for _ in self.commands]
        return [f"{args[0]} {args[1]}" for args in self.commands]


def add_xlen(pipe) -> None:
    pipe.xlen("s")


def read_of(repeatable: bool) -> steps.Steps:
    (reply,) = yield steps.Repeatable(add_xlen) if repeatable else add_xlen
    return reply


def test_on_a_cluster_a_repeatable_step_waits_out_a_node_down_and_another_step_gets_its_error():
    # In a failover the node is down for a while: a read (Repeatable) is sent again with the
    # client's retry policy, as a single command is; another step gets the node's error as its reply.
    cluster = NodeDownCluster(down_for=2)
    assert (steps.run(cluster, read_of(repeatable=True)), cluster.tries) == ("XLEN s", 3)
    cluster = NodeDownCluster(down_for=2)
    reply = steps.run(cluster, read_of(repeatable=False))
    assert (type(reply), str(reply), cluster.tries) == (redis.ConnectionError, "node down", 1)


class Failover:
    """What a client of `redis+sentinel://` meets in a failover, without sentinels: the master they
    name (`master`, an address) moves from `old` to `new`, and `old` drops its clients mid-call.
    Each server's key WHO says which it is."""

    WHO = "failover-test-who"

    def __init__(self, old: EmbeddedRedis, new_url: str):
        self.old = redis.Redis.from_url(old.url, decode_responses=True)
        self.new = redis.Redis.from_url(new_url, decode_responses=True)
        self.old.set(self.WHO, "old")
        self.new.set(self.WHO, "new")
        self.master = self._address(self.old)
        self.timer = threading.Timer(0, lambda: None)

    def discover_master(self, service: str) -> tuple[str, int]:
        return self.master

    async def adiscover_master(self, service: str) -> tuple[str, int]:
        return self.master

    def fail_over_in(self, seconds: float) -> None:
        """In `seconds`: the master is `new`, and `old` drops every client but its own."""

        def fail_over() -> None:
            self.master = self._address(self.new)
            self.old.client_kill_filter(_type="normal", skipme=True)

        self.timer = threading.Timer(seconds, fail_over)
        self.timer.start()

    @staticmethod
    def _address(client: redis.Redis) -> tuple[str, int]:
        options = client.connection_pool.connection_kwargs
        return options["host"], options["port"]


def read_across_a_failover(pipe) -> None:
    """A blocking read (cut short by the failover), then the key that names the server."""
    pipe.xread({"failover-test-stream": "$"}, block=500)
    pipe.get(Failover.WHO)


@pytest.fixture
def failover(redis_server):
    with EmbeddedRedis(port=free_port()) as old:
        setup = Failover(old, redis_server.url)
        yield setup
        setup.timer.join()
        setup.new.delete(Failover.WHO)


SENTINEL_URL = "redis+sentinel://127.0.0.1:1/mili"  # never asked: Failover.discover_master answers
FEW_TRIES = redis.retry.Retry(NoBackoff(), 3)


def test_a_call_cut_off_by_a_failover_is_tried_again_on_the_master_the_sentinels_name_now(failover):
    # redis-py reconnects a connection that its call lost to the address it had, the old master's
    # (which is back here, as a restarted master comes back as a replica): each of the call's tries
    # must ask the sentinels again, or the call never follows the failover.
    client = connect(SENTINEL_URL, decode_responses=True, retry=FEW_TRIES)
    client.connection_pool.sentinel_manager.discover_master = failover.discover_master
    try:
        assert client.get(Failover.WHO) == "old"
        failover.fail_over_in(0.1)
        assert execution.execute(client, read_across_a_failover)[1] == "new"
    finally:
        client.close()


async def test_an_asyncio_call_cut_off_by_a_failover_is_tried_again_on_the_master_the_sentinels_name_now(failover):
    client = connect_async(SENTINEL_URL, decode_responses=True, retry=redis.asyncio.retry.Retry(NoBackoff(), 3))
    client.connection_pool.sentinel_manager.discover_master = failover.adiscover_master
    try:
        assert await client.get(Failover.WHO) == "old"
        failover.fail_over_in(0.1)
        assert (await execution.aexecute(client, read_across_a_failover))[1] == "new"
    finally:
        await client.aclose()


SILENCE_S = 0.5  # more than a redis-server takes to stop, and a socket to take its port


class SilentPort:
    """What a client meets at a host gone silent, on loopback: a socket listening on `port` whose
    queue of one is full, so that each connect waits out its socket_connect_timeout. Counts the
    connects made meanwhile (socket.socket.connect, patched)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.monkeypatch = monkeypatch
        self.sockets: list[socket.socket] = []
        self.connects = 0

    def take(self, port: int) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(0)
        filler = socket.create_connection(("127.0.0.1", port))
        self.sockets += [listener, filler]
        connect = socket.socket.connect

        def counted(sock: socket.socket, address: object) -> None:
            self.connects += 1
            connect(sock, address)

        self.monkeypatch.setattr(socket.socket, "connect", counted)

    def close(self) -> None:
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def going_silent(monkeypatch):
    """A server, and a timer that makes it go silent (SilentPort) 0.2 s after it is started."""
    server = EmbeddedRedis(port=free_port()).start()
    silent = SilentPort(monkeypatch)

    def go_silent() -> None:
        server.stop()
        silent.take(server.port)

    timer = threading.Timer(0.2, go_silent)
    try:
        yield server, silent, timer
    finally:
        if timer.is_alive():
            timer.join()
        silent.close()
        server.stop()


SILENT_TRIES = {"socket_connect_timeout": 0.1, "decode_responses": True}


def test_a_call_that_loses_its_server_connects_again_once_per_try_of_its_retry_policy(going_silent):
    # The server goes silent in the middle of a blocking read: each of the call's two further
    # tries connects once, and waits out its connect timeout. redis-py's connection would try the
    # connect itself twice more within each: six connects. The backoff leaves the server the time
    # to stop and its port to go silent before the first of them.
    server, silent, timer = going_silent
    client = connect(server.url, retry=redis.retry.Retry(ConstantBackoff(SILENCE_S), 2), **SILENT_TRIES)
    try:
        client.ping()
        timer.start()
        with pytest.raises(redis.TimeoutError, match="connecting"):
            execution.execute(client, lambda pipe: pipe.xread({"s": "$"}, block=2000))
        assert silent.connects == 2
    finally:
        client.close()


async def test_an_asyncio_call_that_loses_its_server_connects_again_once_per_try_of_its_retry_policy(going_silent):
    server, silent, timer = going_silent
    client = connect_async(server.url, retry=redis.asyncio.retry.Retry(ConstantBackoff(SILENCE_S), 2), **SILENT_TRIES)
    try:
        await client.ping()
        timer.start()
        with pytest.raises(redis.TimeoutError, match="connecting"):
            await execution.aexecute(client, lambda pipe: pipe.xread({"s": "$"}, block=2000))
        assert silent.connects == 2
    finally:
        await client.aclose()


def test_a_pooled_connection_its_server_closed_is_replaced_before_a_call_spends_a_try_on_it(redis_server):
    # The readiness check of redis-py's checkout, kept in the exchange's: with no retry at all, the
    # call after a CLIENT KILL of every idle connection still succeeds, on a fresh connection.
    client = connect(redis_server.url, decode_responses=True, retry=redis.retry.Retry(NoBackoff(), 0))
    admin = redis.Redis.from_url(redis_server.url)
    try:
        execution.execute(client, lambda pipe: pipe.client_id())
        (before,) = execution.execute(client, lambda pipe: pipe.client_id())
        admin.client_kill_filter(_id=before)
        (after,) = execution.execute(client, lambda pipe: pipe.client_id())
        assert after != before
    finally:
        client.close()
        admin.close()


def test_a_checkouts_readiness_check_asks_the_parser_not_the_connection(redis_server, monkeypatch):
    # The connection's can_read adds a connect (the checkout checks only a connected one) and its
    # host's name for an error message the checkout drops: 3 Python calls of every exchange. The
    # check itself is kept (the test above: a connection its server closed is replaced).
    def refused(*args, **kwargs):
        raise AssertionError("the connection's can_read called")

    client = connect(redis_server.url, decode_responses=True)
    try:
        execution.execute(client, lambda pipe: pipe.ping())
        monkeypatch.setattr(redis.connection.AbstractConnection, "can_read", refused)
        assert execution.execute(client, lambda pipe: pipe.echo("checked")) == ["checked"]
    finally:
        client.close()


def test_max_connections_bounds_the_connections_the_exchanges_hold_at_once(redis_server):
    # As redis-py's pool: past the bound, MaxConnectionsError at once, no try spent waiting for one.
    client = connect(redis_server.url, decode_responses=True, max_connections=2)
    pool = client.connection_pool
    try:
        held = [pool.take(), pool.take()]
        with pytest.raises(redis.exceptions.MaxConnectionsError):
            execution.execute(client, lambda pipe: pipe.ping())
        pool.give_back(held.pop())
        assert execution.execute(client, lambda pipe: pipe.ping()) == [True]  # on the one given back
    finally:
        client.close()


def test_a_round_trip_that_fails_between_its_replies_leaves_none_of_them_to_the_next_call(redis_server):
    # A reply that fails in its parsing (here the first GET's, by a callback that raises) leaves
    # the pipeline's later replies unread: redis-py's checkout does not count unread data as dirty
    # where its maintenance notifications are on (its default), so the next call on that
    # connection would read them as its own.
    client = connect(redis_server.url, decode_responses=True, max_connections=1)
    client.set("unread-a", "a")
    client.set("unread-b", "b")

    def refuse(response, **options):
        raise ValueError("refused")

    try:
        client.response_callbacks["GET"] = refuse
        with pytest.raises(ValueError, match="refused"):
            execution.execute(client, lambda pipe: (pipe.get("unread-a"), pipe.get("unread-b")))
        del client.response_callbacks["GET"]
        assert execution.execute(client, lambda pipe: pipe.get("unread-a")) == ["a"]
    finally:
        client.close()
