"""How every MILI component talks to Redis: the URLs of its three modes and the one place that
makes sync and asyncio clients of them, the clients' retry policy, which errors no retry mends,
the code of an error reply, Redis URLs as they may be shown (without a password), and probes
that fail fast where a client would retry for seconds.

    redis://[user:pass@]host:port/db, rediss://..., unix:///path.sock    one server (redis-py's URLs)
    redis+cluster://[user:pass@]host:port[,host:port...]                  Redis Cluster: any nodes of it
    redis+sentinel://[user:pass@]host:port[,host:port...]/SERVICE          Sentinel: its sentinels, the master's name

`rediss+cluster://` and `rediss+sentinel://` use TLS (to the sentinels too). The credentials are
the data nodes': sentinels are asked for the master without them. A query string takes redis-py's
URL options (`?socket_timeout=5&ssl_cert_reqs=none`) in every mode.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import threading
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NoReturn, TypeVar, overload
from urllib.parse import SplitResult, parse_qsl, quote, unquote, urlsplit

import redis
import redis.asyncio
import redis.asyncio.connection
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.connection
import redis.exceptions
import redis.retry
import redis.sentinel
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.cluster import ClusterNode
from redis.commands.sentinel import SentinelMastersResponse
from redis.connection import URL_QUERY_ARGUMENT_PARSERS
from redis.connection import parse_url as redis_py_url_options

from producer_client import forks
from producer_client.cluster import AsyncCluster, AsyncRedis, Cluster, NotACluster, SyncRedis
from producer_client.errors import (
    CredentialsRefused,
    InvalidArgument,
    MiliError,
    PermissionDenied,
    RedisOutOfMemory,
    RedisReadOnly,
    RedisTimedOut,
    RedisUnavailable,
)
from producer_client.pooling import (
    ASYNC_ONCE_PER_TRY,
    ONCE_PER_TRY,
    AsyncExchangePool,
    AsyncSentinelPool,
    ExchangePool,
    SentinelPool,
    set_aside,
)

# Every call of the clients is safe to repeat: reads, CANCEL, and submits (CREATE never sets a
# started job back to queued; an entry enqueued twice is dropped by the worker that claims the
# second). So redis-py retries each call on a lost connection, with exponential backoff and
# jitter: 10 retries over about 6 s, which rides out a Redis restart. Under Sentinel or on a cluster
# a lost master comes back as a failover, which takes longer (Redis first waits out
# down-after-milliseconds or cluster-node-timeout, then elects a replica): 40 retries there, about
# 36 s (see RETRIES; redis-py waits min(cap, U * base * 2**failure) after each failure, U uniform).
RETRY_BASE_S = 0.05
RETRY_CAP_S = 1.0
# Errors that retrying cannot mend: wrong credentials, an ACL that forbids a command, or a cluster's
# URL naming a server that is none. redis-py raises the first two as kinds of ConnectionError,
# which it would otherwise retry.
FATAL_ERRORS = (
    redis.AuthenticationError,
    redis.exceptions.AuthorizationError,
    redis.exceptions.NoPermissionError,
    NotACluster,
)

# What redact_url shows of a query: redis-py's own URL options (numbers, booleans, TLS settings)
# with plain values; never a value that could be a password.
_PLAIN_VALUE = re.compile(r"[A-Za-z0-9._-]{0,32}")
SHOWN_OPTIONS = frozenset(URL_QUERY_ARGUMENT_PARSERS) | {"ssl_cert_reqs", "client_name"}
# The options a URL's query may set: redis-py's connection options that a user gives as text (not
# its internals, such as parser_class), each where the connection made takes it (ssl_* with
# rediss:// only, socket_keepalive not on a unix socket), and the pool's size.
USER_OPTIONS = (
    frozenset(URL_QUERY_ARGUMENT_PARSERS)
    | {"username", "password", "client_name"}
    | {
        name
        for name in inspect.signature(redis.connection.SSLConnection.__init__).parameters
        if name.startswith("ssl_")
    }
)
POOL_OPTIONS = frozenset({"max_connections"})
_KIND = {
    redis.connection.Connection: "a TCP connection",
    redis.connection.SSLConnection: "a TLS connection (rediss://)",
    redis.connection.UnixDomainSocketConnection: "a unix socket",
}
T = TypeVar("T")
# Characters a URL reserves: in a user name or password they must be percent-encoded, or the URL
# splits elsewhere than its writer meant (its host would be part of the password).
RESERVED_IN_CREDENTIALS = "/?#"


class Mode(str, Enum):
    SERVER = "server"
    CLUSTER = "cluster"
    SENTINEL = "sentinel"


Fail = Callable[[Exception], Any] | Callable[[Exception, int], Any]  # what redis-py's Retry calls after a failed try


def _never_fatal(error: Exception) -> bool:
    return not isinstance(error, FATAL_ERRORS)


def _not_fatal(is_retryable: Callable[[Exception], bool] | None) -> Callable[[Exception], bool]:
    """`is_retryable`, and never for FATAL_ERRORS. Without one (every pooled connection's connect,
    a no-op once connected, asks at each checkout), a function made once."""
    if is_retryable is None:
        return _never_fatal

    def retryable(error: Exception) -> bool:
        return not isinstance(error, FATAL_ERRORS) and is_retryable(error)

    return retryable


class Retry(redis.retry.Retry):
    """A redis-py Retry that gives up at once on FATAL_ERRORS."""

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Fail,
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        return super().call_with_retry(do, fail, _not_fatal(is_retryable), with_failure_count)


class AsyncRetry(redis.asyncio.retry.Retry):
    """Retry, for redis.asyncio."""

    async def call_with_retry(
        self,
        do: Callable[[], Awaitable[T]],
        fail: Fail,
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        return await super().call_with_retry(do, fail, _not_fatal(is_retryable), with_failure_count)


def retry_policy(mode: Mode | None = None) -> Retry:
    """The clients' retries of a call, in `mode` (one server if None)."""
    return Retry(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), RETRIES[mode or Mode.SERVER])


def async_retry_policy(mode: Mode | None = None) -> AsyncRetry:
    return AsyncRetry(ExponentialWithJitterBackoff(base=RETRY_BASE_S, cap=RETRY_CAP_S), RETRIES[mode or Mode.SERVER])


def one_try_options(timeout_s: float, for_asyncio: bool = False) -> dict[str, Any]:
    """Client options for calls that fail fast: one try each, every socket wait at most timeout_s."""
    retry = AsyncRetry(NoBackoff(), 0) if for_asyncio else Retry(NoBackoff(), 0)
    return {"retry": retry, "socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}


def is_fatal(error: BaseException) -> bool:
    return isinstance(error, FATAL_ERRORS)


def reply_code(error: BaseException) -> str:
    """The first word of an error reply (NOGROUP, BUSY, UNBLOCKED...), wherever redis-py keeps it:
    it strips the words it has a class for (OOM, READONLY...) into `status_code`."""
    code = getattr(error, "status_code", None)
    if code:
        return str(code)
    text = str(error.args[0]) if error.args else ""
    return text.split(" ", 1)[0]


def is_other_type(reply: object) -> bool:
    """Whether `reply` (a pipeline's, errors in place) is WRONGTYPE: a key of another type."""
    return isinstance(reply, Exception) and reply_code(reply) == "WRONGTYPE"


def unless_other_type(reply: Any, missing: Any) -> Any:
    """`reply` (a pipeline's, errors in place), or what a missing key answers where it is WRONGTYPE:
    producers may write the set of lane streams and the scheduler hash, and one of another type,
    which the scripts make anew (protocol.lanes.LUA_LANES), must stop no read of theirs meanwhile
    (stats, the board, metrics, the shard count). Any other error is raised."""
    if is_other_type(reply):
        return missing
    if isinstance(reply, Exception):
        raise reply
    return reply


def redact_url(url: object) -> str:
    """`url` as messages and logs may show it: rebuilt from its parsed parts, never by a pattern on
    the raw text. Everything up to the URL's last `@` is its user name and password, however
    they are written (`/`, `#`, `:`, `@` or percent-escapes in them), and shows as `***`: not
    the user name either, since a password typed into the user-only form, or with a colon, reads
    as one. Of the query only redis-py's numeric and boolean options show; any other option
    (`password=`, or a name that is part of a password with a raw `&`) shows as ***. Text that is
    no Redis URL shows no part of itself."""
    if not isinstance(url, str):
        return "<not a URL>"
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        return "<not a Redis URL>"
    _, at, located = rest.rpartition("@")
    try:
        parts = urlsplit(f"{scheme}://{located}")
    except ValueError:  # a bracketed host that is no IPv6 address
        return f"{scheme}://<unparsable>"
    query = _shown_query(parts.query)
    return f"{scheme}://{'***@' if at else ''}{parts.netloc}{parts.path}{'?' + query if query else ''}"


def _shown_query(query: str) -> str:
    pairs = parse_qsl(query, keep_blank_values=True)
    shown = [f"{name}={value}" for name, value in pairs if name in SHOWN_OPTIONS and _PLAIN_VALUE.fullmatch(value)]
    return "&".join(shown + (["***"] if len(shown) < len(pairs) else []))


# -- errors at the clients' boundary ---------------------------------------------------------------

# What a call that failed raises once its tries are spent (protocol.execution, the one way every
# call of the clients and workers goes): MILI's typed error for each of these, a kind of the
# redis-py class it stands for, so that code catching redis-py's classes catches it still and the
# retry policy, which saw redis-py's own errors try by try, is not in its way.
REDIS_FAILURES = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.NoPermissionError)
# Not Redis's failure: the client's own pool is at max_connections.
_OWN_LIMITS = (redis.exceptions.MaxConnectionsError,)
_SCRIPT_CALLS = frozenset({"EVALSHA", "EVAL", "EVALSHA_RO", "EVAL_RO", "FCALL", "FCALL_RO"})


def typed_failure(error: Exception, client: object, commands: Sequence[tuple[Any, ...]]) -> Exception:
    """`error`, raised by an exchange of `commands` (each its arguments) with `client`, as MILI's
    typed error: PermissionDenied, CredentialsRefused, RedisTimedOut or RedisUnavailable, naming
    the server without the URL's credentials; any other error as it is."""
    if isinstance(error, (MiliError, *_OWN_LIMITS)):
        return error
    if isinstance(error, redis.exceptions.NoPermissionError):
        if len(commands) == 1:
            return permission_denied(commands[0], error)
        return PermissionDenied(
            "one of " + ", ".join(dict.fromkeys(str(args[0]).upper() for args in commands)), str(error)
        )
    where = server_of(client)
    if isinstance(error, redis.AuthenticationError):
        return CredentialsRefused(where, str(error))
    if isinstance(error, redis.exceptions.AuthorizationError):
        return error  # NOAUTH and the like: redis-py's own class, which no MILI error stands for
    if isinstance(error, redis.TimeoutError):
        return RedisTimedOut(where, f"{type(error).__name__}: {error}")
    return RedisUnavailable(where, f"{type(error).__name__}: {error}")


def raise_typed(error: Exception, client: object, commands: Sequence[tuple[Any, ...]]) -> NoReturn:
    """Raise typed_failure's error for `error`, caused by it; `error` itself where it is its own."""
    typed = typed_failure(error, client, commands)
    if typed is error:
        raise error
    raise typed from error


def typed_refusal(args: tuple[Any, ...], error: Exception) -> Exception:
    """The error reply `error` of the command of `args` as MILI's typed error where it has one
    (PermissionDenied for NOPERM, RedisOutOfMemory for OOM, RedisReadOnly for READONLY), each a
    kind of redis-py's class: a caller of many jobs (submit_many) learns from it which went in
    (MiliError.job_ids). Any other reply as it is."""
    if isinstance(error, MiliError):
        return error
    if isinstance(error, redis.exceptions.NoPermissionError):
        return permission_denied(args, error)
    if isinstance(error, redis.exceptions.OutOfMemoryError):
        return RedisOutOfMemory(command_of(args), str(error))
    if isinstance(error, redis.exceptions.ReadOnlyError):
        return RedisReadOnly(command_of(args), str(error))
    return error


def permission_denied(args: tuple[Any, ...], error: BaseException) -> PermissionDenied:
    """The NOPERM reply `error` of the command of `args` as PermissionDenied (command_of)."""
    return PermissionDenied(command_of(args), str(error))


def command_of(args: tuple[Any, ...]) -> str:
    """The command of `args` as an error names it, with the key its rights are about: a script's
    first key (each script's keys are of one owner: the producers' or the workers',
    docs/security.md), else a command's first argument."""
    name = str(args[0]).upper()
    if name in _SCRIPT_CALLS:
        return (
            f"a script ({name}) on key {args[3]!r}" if len(args) > 3 and str(args[2]) != "0" else f"a script ({name})"
        )
    if len(args) > 1 and name not in ("XREAD", "XREADGROUP"):
        return f"{name} on {args[1]!r}"
    return name


def server_of(client: object) -> str:
    """The server(s) `client` talks to, as a message may show them: host:port (or a unix socket's
    path), a cluster's startup nodes, a sentinel's service; never a user name or password."""
    nodes = getattr(getattr(client, "nodes_manager", None), "startup_nodes", None)
    if nodes:
        return "the cluster of " + ",".join(nodes)
    pool = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service:
        return f"the master of Sentinel's service {service!r}"
    return _server_of_options(getattr(pool, "connection_kwargs", {}))


def server_of_url(target: RedisURL) -> str:
    """server_of's text for the client `target` makes, before one is made (a cluster's client
    reads the topology when it is made, so a failure to connect leaves none to ask)."""
    if target.mode is Mode.CLUSTER:
        return "the cluster of " + ",".join(f"{host}:{port}" for host, port in target.nodes)
    if target.mode is Mode.SENTINEL:
        return f"the master of Sentinel's service {target.service!r}"
    return _server_of_options(target.options)


def _server_of_options(options: dict[str, Any]) -> str:
    if "path" in options:
        return f"unix:{options['path']}"
    return f"{options.get('host', '?')}:{options.get('port', DEFAULT_PORT[Mode.SERVER])}"


# -- URLs ------------------------------------------------------------------------------------------

RETRIES = {Mode.SERVER: 10, Mode.CLUSTER: 40, Mode.SENTINEL: 40}
SCHEMES = {
    "redis": (Mode.SERVER, False),
    "rediss": (Mode.SERVER, True),
    "unix": (Mode.SERVER, False),
    "redis+cluster": (Mode.CLUSTER, False),
    "rediss+cluster": (Mode.CLUSTER, True),
    "redis+sentinel": (Mode.SENTINEL, False),
    "rediss+sentinel": (Mode.SENTINEL, True),
}
DEFAULT_PORT = {Mode.SERVER: 6379, Mode.CLUSTER: 6379, Mode.SENTINEL: 26379}  # redis-py's and Redis's
# A one-server URL's path: its database, as a number (redis-py would take `/abc` for database 0
# and `/1/2` for database 12).
_DB_PATH = re.compile(r"/?|/\d{1,9}")
# The numeric options of a URL's query, each with what it must be: redis-py takes any number, and
# a socket timeout of 0 or less failed in the socket module at the first command (a traceback),
# or made a non-blocking socket whose connect never succeeds.
_SECONDS = ("a number of seconds above 0", lambda v: 0 < v < float("inf"))
_OPTION_RANGES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "socket_timeout": _SECONDS,
    "socket_connect_timeout": _SECONDS,
    "timeout": _SECONDS,
    "health_check_interval": ("a whole number of seconds, 0 or more", lambda v: v >= 0),
    "max_connections": ("a whole number from 1", lambda v: v >= 1),
    "socket_read_size": ("a whole number of bytes from 1", lambda v: v >= 1),
    "db": ("a database number, 0 or more", lambda v: v >= 0),
    "protocol": ("2 or 3 (RESP2, RESP3)", lambda v: v in (2, 3)),
}
_HOST_PORT = re.compile(r"(?:\[(?P<ipv6>[0-9A-Fa-f:.]+)\]|(?P<host>[^:\[\]]+))(?::(?P<port>\d{1,5}))?")


@dataclass(frozen=True)
class RedisURL:
    """A parsed Redis URL. `nodes`: a cluster's startup nodes or the sentinels; `options`: the
    connection's keyword arguments for redis-py (credentials, TLS, the query string's)."""

    text: str
    mode: Mode
    nodes: tuple[tuple[str, int], ...] = ()
    service: str = ""
    options: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return redact_url(self.text)


def parse_url(url: Any) -> RedisURL:
    """Check `url` before anything connects; InvalidArgument naming `redis` if it is not usable."""
    if not isinstance(url, str):
        raise InvalidArgument("redis", "must be a URL such as redis://host:6379/0")
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in SCHEMES:
        raise _bad(url, f"unknown scheme; use one of {', '.join(s + '://' for s in SCHEMES)}")
    parts = _split(url)
    mode, tls = SCHEMES[scheme]
    if mode is Mode.SERVER:
        options = _redis_py_options(url, url)
        _check_query(url, parts.query, options.get("connection_class", redis.connection.Connection))
        _check_server_named(url, scheme, options)
        if scheme != "unix" and not _DB_PATH.fullmatch(unquote(parts.path)):
            raise _bad(url, "its path must be a database number, such as /0")
        return RedisURL(url, mode, options=options)
    _check_query(url, parts.query, redis.connection.SSLConnection if tls else redis.connection.Connection)
    userinfo, _, hosts = parts.netloc.rpartition("@")
    nodes = tuple(_node(url, text, DEFAULT_PORT[mode]) for text in hosts.split(","))
    options = _redis_py_options(
        url, f"{'rediss' if tls else 'redis'}://{userinfo}{'@' if userinfo else ''}h/?{parts.query}"
    )
    for name in ("host", "port", "connection_class"):
        options.pop(name, None)
    if tls:
        options["ssl"] = True
    if mode is Mode.CLUSTER:
        if parts.path not in ("", "/", "/0") or options.pop("db", 0) != 0:
            raise _bad(url, "a cluster has database 0 only: give no path")
        return RedisURL(url, mode, nodes, options=options)
    service = unquote(parts.path[1:])
    if not service or "/" in service:
        raise _bad(url, "name the master's service after the sentinels: redis+sentinel://host:26379/mymaster")
    return RedisURL(url, mode, nodes, service, options)


def _split(url: str) -> SplitResult:
    """urlsplit's parts, once sure that its user name and password are all in its netloc: an `@`
    past the netloc means a reserved character (/ ? #) in them, not percent-encoded."""
    try:
        parts = urlsplit(url)
    except ValueError:  # its message may quote the netloc, password and all
        raise _bad(url, "it does not parse as a URL (a bracketed host that is no IPv6 address?)") from None
    netloc_end = len(url.partition("://")[0]) + 3 + len(parts.netloc)
    if "@" in url[netloc_end:]:
        encoded = ", ".join(f"{c} as {quote(c, safe='')}" for c in RESERVED_IN_CREDENTIALS)
        raise _bad(url, f"percent-encode the user name and password ({encoded}, @ as %40) or any @ after them")
    return parts


def _check_server_named(url: str, scheme: str, options: dict[str, Any]) -> None:
    """A one-server URL names its host (or its socket's path), as a cluster's and Sentinel's name
    their nodes: redis-py takes none for localhost, and sent a URL's credentials there when an
    empty ${REDIS_HOST} had made `redis://user:pw@/0` of one meant for another server."""
    if scheme == "unix":
        if not options.get("path"):
            raise _bad(url, "name the socket's path: unix:///path/to/redis.sock")
    elif not options.get("host"):
        raise _bad(url, f"name the server's host: {scheme}://host:6379/0")


def _redis_py_options(url: str, text: str) -> dict[str, Any]:
    try:
        options: dict[str, Any] = redis_py_url_options(text)  # redis-py's parse_url is unannotated
    except ValueError as e:
        raise _bad(url, str(e)) from None
    for name, (what, holds) in _OPTION_RANGES.items():
        if name in options and not holds(options[name]):
            raise _bad(url, f"its option {name} must be {what}")
    return options


def _check_query(url: str, query: str, connection: type) -> None:
    """Every option of the query one that `connection` takes: redis-py passes any name on to the
    connection, which raised TypeError at its first command. The message names no option: with a
    raw `&` in a password, a part of the password reads as one."""
    if any(name not in _taken_options(connection) for name, _ in parse_qsl(query, keep_blank_values=True)):
        raise _bad(url, f"its query holds an option that is none of redis-py's for {_KIND[connection]}")


def _taken_options(connection: type) -> frozenset[str]:
    parameters = {name for kind in connection.__mro__ for name in _parameters(kind)}
    return frozenset(parameters & USER_OPTIONS) | POOL_OPTIONS


def _parameters(kind: type) -> list[str]:
    init = kind.__dict__.get("__init__")
    return list(inspect.signature(init).parameters) if init is not None else []


def _node(url: str, text: str, default_port: int) -> tuple[str, int]:
    match = _HOST_PORT.fullmatch(text)
    if match is None:
        raise _bad(url, f"{text!r} is not host:port")
    port = int(match["port"] or default_port)
    if not 0 < port < 65536:
        raise _bad(url, f"port {port} is out of range")
    return unquote(match["ipv6"] or match["host"]), port


def _bad(url: str, reason: str) -> InvalidArgument:
    return InvalidArgument("redis", f"{redact_url(url)}: {reason}")


# -- clients -----------------------------------------------------------------------------------------


def connect(url: str | RedisURL, **kwargs: Any) -> SyncRedis:
    """A synchronous client of `url` in its mode: redis.Redis (one server, or the master a
    sentinel names, followed across failovers) or a cluster client, with `kwargs` (decode_responses,
    retry, max_connections, ...) given to every connection. A cluster client reads the cluster's
    topology now, trying as often as `retry` allows."""
    target = url if isinstance(url, RedisURL) else parse_url(url)
    if target.mode is Mode.SERVER:
        kind = ONCE_PER_TRY[target.options.get("connection_class", redis.connection.Connection)]
        return redis.Redis.from_pool(ExchangePool.from_url(target.text, connection_class=kind, **kwargs))
    if target.mode is Mode.SENTINEL:
        sentinels = Sentinels(
            list(target.nodes), sentinel_kwargs=_sentinel_options(target, kwargs, Retry(NoBackoff(), 0))
        )
        return sentinels.master(target.service, **_merged(target, kwargs))
    nodes = [ClusterNode(host, port) for host, port in target.nodes]
    retry: redis.retry.Retry | None = kwargs.get("retry")

    def make() -> Cluster:
        return Cluster(startup_nodes=list(nodes), **_merged(target, kwargs))

    return make() if retry is None else retry.call_with_retry(make, lambda error: None)


def connect_async(url: str | RedisURL, **kwargs: Any) -> AsyncRedis:
    """`connect` for asyncio: redis.asyncio clients, which connect at their first command."""
    target = url if isinstance(url, RedisURL) else parse_url(url)
    if target.mode is Mode.SERVER:
        # As redis.asyncio's from_url, which would give the URL's own connection_class precedence.
        options: dict[str, Any] = {**kwargs, **redis.asyncio.connection.parse_url(target.text)}
        kind = ASYNC_ONCE_PER_TRY[options.get("connection_class", redis.asyncio.connection.Connection)]
        return redis.asyncio.Redis.from_pool(AsyncExchangePool(**{**options, "connection_class": kind}))
    if target.mode is Mode.SENTINEL:
        sentinels = AsyncSentinels(
            list(target.nodes), sentinel_kwargs=_sentinel_options(target, kwargs, AsyncRetry(NoBackoff(), 0))
        )
        return sentinels.master(target.service, **_merged(target, kwargs))
    nodes = [AsyncClusterNode(host, port) for host, port in target.nodes]
    return AsyncCluster(startup_nodes=nodes, **_merged(target, kwargs))


def _merged(target: RedisURL, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The caller's keyword arguments (None: redis-py's default, which the cluster clients spell
    otherwise) and the URL's options, the URL's first, as redis-py's from_url has it."""
    return {**{k: v for k, v in kwargs.items() if v is not None}, **target.options}


def _sentinel_options(target: RedisURL, kwargs: dict[str, Any], retry: Retry | AsyncRetry) -> dict[str, Any]:
    """What the connections to the sentinels share with the master's: TLS and socket settings.
    Each sentinel is asked once per discovery, then the next: the caller's policy (`retry` of the
    master's connections) repeats the whole discovery. redis-py's default would retry a dead
    sentinel for seconds before it asks the next one, within each of the caller's tries."""
    shared = {k: v for k, v in _merged(target, kwargs).items() if k.startswith(("socket_", "ssl"))}
    return {**shared, "retry": retry}


class SentinelUnreachable(redis.ConnectionError):
    """A sentinel that did not answer, shown with its cause: redis-py's MasterNotFoundError lists
    each sentinel's error by its repr, which redis-py 8 reduces to the error's class."""

    def __repr__(self) -> str:
        return str(self)


class SentinelNode(redis.Redis):
    """A sentinel's client, shown as its address: MasterNotFoundError names each sentinel it asked
    by its repr, which would be a screenful of connection settings."""

    def __repr__(self) -> str:
        return _sentinel_repr(self)

    def sentinel_masters(self) -> SentinelMastersResponse:
        try:
            return super().sentinel_masters()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise SentinelUnreachable(f"{type(e).__name__}: {e}") from e


class AsyncSentinelNode(redis.asyncio.Redis):
    """A sentinel's asyncio client: set aside in a forked child, as the master's pool is."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        forks.reset_after_fork(self)

    def after_fork_in_child(self) -> None:
        set_aside(self.connection_pool)

    def __repr__(self) -> str:
        return _sentinel_repr(self)

    async def sentinel_masters(self) -> SentinelMastersResponse:
        try:
            return await super().sentinel_masters()
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise SentinelUnreachable(f"{type(e).__name__}: {e}") from e


def _sentinel_repr(client: redis.Redis | redis.asyncio.Redis) -> str:
    options = client.connection_pool.connection_kwargs
    return f"<sentinel {options.get('host')}:{options.get('port')}>"


# redis-py's Sentinel classes are unannotated: their methods are called by their class below, not
# through super() or a subclass's instance, so that mypy's untyped_calls_exclude (pyproject.toml)
# knows them as redis-py's.


class Sentinels(redis.sentinel.Sentinel):
    def __init__(self, nodes: list[tuple[str, int]], sentinel_kwargs: dict[str, Any]):
        redis.sentinel.Sentinel.__init__(self, nodes, sentinel_kwargs=sentinel_kwargs)
        self.sentinels = [SentinelNode(host, port, **sentinel_kwargs) for host, port in nodes]

    def master(self, service: str, **kwargs: Any) -> SentinelMaster:
        """The client of `service`'s master, followed across failovers."""
        connection_class = SentinelSSLConnection if kwargs.pop("ssl", False) else SentinelConnection
        master: SentinelMaster = redis.sentinel.Sentinel.master_for(
            self,
            service,
            redis_class=SentinelMaster,
            connection_pool_class=SentinelPool,
            connection_class=connection_class,
            **kwargs,
        )
        return master


class AsyncSentinels(redis.asyncio.sentinel.Sentinel):
    def __init__(self, nodes: list[tuple[str, int]], sentinel_kwargs: dict[str, Any]):
        redis.asyncio.sentinel.Sentinel.__init__(self, nodes, sentinel_kwargs=sentinel_kwargs)
        self.sentinels = [AsyncSentinelNode(host=host, port=port, **sentinel_kwargs) for host, port in nodes]

    def master(self, service: str, **kwargs: Any) -> AsyncSentinelMaster:
        connection_class = AsyncSentinelSSLConnection if kwargs.pop("ssl", False) else AsyncSentinelConnection
        master: AsyncSentinelMaster = redis.asyncio.sentinel.Sentinel.master_for(
            self,
            service,
            redis_class=AsyncSentinelMaster,
            connection_pool_class=AsyncSentinelPool,
            connection_class=connection_class,
            **kwargs,
        )
        return master


class SentinelConnection(redis.sentinel.SentinelManagedConnection):
    """A connection to the master the sentinels name, asked again each time it connects. redis-py
    asks them when a call takes a connection from the pool, but a connection that the call lost
    mid-way (its master killed during a blocking read) is connected again by the call's own
    retries to the address it had: the old master's, refused until that server is back, then a
    replica, which serves reads from its copy and refuses writes (READONLY), each try going back
    to it. Such a call never follows the failover: a write fails once its tries are spent, a
    read's connection goes back to the pool still on the replica. Here each try connects once to
    the master named then; the call's retry policy (RETRIES) spaces and counts the tries."""

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            redis.sentinel.SentinelManagedConnection._connect_retry(self)
        redis.sentinel.SentinelManagedConnection.send_packed_command(self, command, check_health)


class SentinelSSLConnection(SentinelConnection, redis.connection.SSLConnection):
    pass


class AsyncSentinelConnection(redis.asyncio.sentinel.SentinelManagedConnection):
    """SentinelConnection, for asyncio."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await redis.asyncio.sentinel.SentinelManagedConnection._connect_retry(self)
        await redis.asyncio.sentinel.SentinelManagedConnection.send_packed_command(self, command, check_health)


class AsyncSentinelSSLConnection(AsyncSentinelConnection, redis.asyncio.connection.SSLConnection):
    pass


class SentinelMaster(redis.Redis):
    """The master a sentinel names: closing it closes the connections to the sentinels too."""

    connection_pool: redis.sentinel.SentinelConnectionPool  # master_for gives it one

    def close(self) -> None:
        super().close()
        for sentinel in self.connection_pool.sentinel_manager.sentinels:
            sentinel.close()


class AsyncSentinelMaster(redis.asyncio.Redis):
    connection_pool: redis.asyncio.sentinel.SentinelConnectionPool  # master_for gives it one

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        for sentinel in self.connection_pool.sentinel_manager.sentinels:
            await sentinel.aclose()


# -- probes ------------------------------------------------------------------------------------------

# How long a health check or a CLI command waits for Redis by default before it says it cannot
# reach it: a probe with a timeout of a second or two must see the answer, not its own timeout.
PROBE_TIMEOUT_S = 1.5


def not_redis(error: redis.exceptions.InvalidResponse) -> str:
    """The cause of an InvalidResponse at a program's first call: the URL's address and port answer,
    but not in Redis's protocol (an HTTP server's port: the gateway's 8000 for Redis's 6379). No
    retry makes that server Redis."""
    return f"the server there answers as no Redis server does ({type(error).__name__}: {error}): is this Redis's address and port?"


class Unreachable(redis.ConnectionError):
    """Redis refused, dropped or did not answer a probe; the text says which (the cause's type and
    message, or that nothing came within the bound)."""


def ping(client: SyncRedis) -> bool:
    return client.ping()


@overload
def probe(url: str | RedisURL, timeout_s: float) -> bool: ...
@overload
def probe(url: str | RedisURL, timeout_s: float, check: Callable[[SyncRedis], T]) -> T: ...
def probe(url: str | RedisURL, timeout_s: float, check: Callable[[SyncRedis], Any] = ping) -> Any:
    """`check(client)`'s answer (PING by default) within timeout_s, on a client of `url` that
    tries each call once: for health checks and commands that must fail fast, where a client's
    calls retry for seconds (RETRIES) and a cluster's or a sentinel's discovery tries every node.
    The check runs on a thread of its own, so that nothing (a name that does not resolve, several
    silent nodes one after the other) outlasts the bound. Unreachable if Redis refuses, drops or
    does not answer; other errors (a wrong password, a command the ACL forbids) as raised."""
    target = url if isinstance(url, RedisURL) else parse_url(url)
    outcome: list[tuple[object, BaseException | None]] = []

    def run() -> None:
        client = None
        try:
            client = connect(target, decode_responses=True, **one_try_options(timeout_s))
            outcome.append((check(client), None))
        except Exception as e:  # whatever it is, the caller's thread raises it
            outcome.append((None, e))
        finally:
            if client is not None:
                client.close()

    thread = threading.Thread(target=run, name="mili-redis-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise Unreachable(f"no answer within {timeout_s:g} s")
    answer, error = outcome[0]
    if error is not None:
        raise unreachable_or_itself(error)
    return answer


async def answered_within(timeout_s: float, call: Awaitable[T]) -> T:
    """`probe` for asyncio: `call`'s answer (on a client made with one_try_options) within timeout_s."""
    try:
        return await asyncio.wait_for(call, timeout_s)
    except asyncio.TimeoutError:
        raise Unreachable(f"no answer within {timeout_s:g} s") from None
    except redis.RedisError as e:
        raise unreachable_or_itself(e) from None


def describe(error: BaseException) -> str:
    """An error as a line of a message: its type and text (Unreachable's text says its cause's type)."""
    return str(error) if isinstance(error, Unreachable) else f"{type(error).__name__}: {error}"


def unreachable_or_itself(error: BaseException) -> BaseException:
    """Unreachable for an error that says Redis could not be reached (or that no Redis is where the
    URL points); any other error as it is."""
    if isinstance(error, RedisUnavailable):  # a check's call through the client's boundary: its cause
        return Unreachable(error.detail)
    if isinstance(error, redis.exceptions.InvalidResponse):
        return Unreachable(not_redis(error))
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)) and not is_fatal(error):
        return Unreachable(f"{type(error).__name__}: {error}")
    return error
