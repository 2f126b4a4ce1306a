"""Redis Cluster through redis-py's cluster clients (sync and asyncio), with the two changes MILI
needs; producer_client.connection builds them from `redis+cluster://` URLs.

1. Scripts and stream reads route by their keys, found here. redis-py learns the keys of
   commands whose key positions move (EVALSHA, XREAD, XREADGROUP) by asking a node, COMMAND
   GETKEYS: one more round trip for each script call in a pipeline (a worker's step publishes
   one per job), for every blocking read of a client and every read of a worker, each to one
   node that must be up for anything to be sent.
2. A topology that cannot be used right now (no startup node answers, the slots are not all
   covered in the middle of a failover) raises what any outage raises, a redis ConnectionError
   or ClusterDownError, which the clients retry and the workers back off from. redis-py raises
   it as RedisClusterException, which is no RedisError.
3. A call that fails for want of a node (it died, its slots are not served yet) is tried again
   with the caller's backoff (`retry`: the clients' policy, or the worker's one immediate retry),
   the topology read again before each try. redis-py's own cluster retries wait for nothing, so
   they would all be spent in the first milliseconds of a failover, long before a replica is
   promoted. Pipelines (producer_client.protocol.execution) are sent again the same way.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar, cast

import redis
import redis.asyncio.retry
import redis.retry
from redis._parsers import AsyncCommandsParser, CommandsParser
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError
from typing_extensions import TypeIs

from producer_client import forks
from producer_client.errors import PermissionDenied

SCRIPT_CALLS = frozenset({"EVAL", "EVALSHA"})
STREAM_READS = frozenset({"XREAD", "XREADGROUP"})
# What a failover or a resharding answers until the cluster serves every slot again.
NODE_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError)
T = TypeVar("T")
R = TypeVar("R", redis.retry.Retry, redis.asyncio.retry.Retry)


def known_keys(args: Sequence[Any]) -> list[Any] | None:
    """The keys of a script call (EVAL, EVALSHA: `numkeys` of them after it) or of a stream
    read (XREAD, XREADGROUP: the first half of what follows STREAMS); None for other commands."""
    command = str(args[0]).upper()
    if command in SCRIPT_CALLS:
        return list(args[3 : 3 + int(args[2])]) or None
    if command not in STREAM_READS:
        return None
    words = [a.decode() if isinstance(a, bytes) else a for a in args]
    at = next(i for i, word in enumerate(words) if isinstance(word, str) and word.upper() == "STREAMS")
    streams_and_ids = words[at + 1 :]
    return streams_and_ids[: len(streams_and_ids) // 2]


class NotACluster(redis.ResponseError):
    """A `redis+cluster://` URL's node answered that it runs with cluster mode off: one server,
    which no retry makes a cluster (producer_client.connection counts it among the fatal errors).
    redis-py raised it as a RedisClusterException, which no caller of a client catches."""


NOT_A_CLUSTER = "Cluster mode is not enabled on this node"


class topology_errors:
    """Raise a cluster that cannot be used now as a RedisError (see the module's docstring). A class
    rather than a @contextmanager: every pipeline of a client and a worker goes through it, and a
    generator-based one costs four more Python calls each time."""

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, e: BaseException | None, traceback: TracebackType | None
    ) -> Literal[False]:
        if not isinstance(e, RedisClusterException):
            return False
        if isinstance(e.__cause__, redis.RedisError):
            raise e.__cause__ from None  # e.g. "cannot be connected", from the ConnectionError behind it
        refused = acl_refusal(e)
        if refused is not None:
            raise PermissionDenied(
                "CLUSTER SLOTS (with which a cluster client reads the topology)", str(refused)
            ) from None
        if NOT_A_CLUSTER in str(e):
            raise NotACluster(f"{NOT_A_CLUSTER}: for one server, use a redis:// URL") from None
        if isinstance(e, SlotNotCoveredError) or str(e).startswith("All slots are not covered"):
            raise ClusterDownError(str(e)) from e
        return False


def acl_refusal(error: BaseException) -> redis.exceptions.NoPermissionError | None:
    """The NOPERM behind a topology error, if one is: redis-py reads any error reply to a startup
    node's CLUSTER SLOTS as a node with cluster mode off (NOT_A_CLUSTER), an ACL's refusal too,
    keeping the reply only as the error's context, a few errors down."""
    seen = error.__cause__ or error.__context__
    for _ in range(8):
        if seen is None or isinstance(seen, redis.exceptions.NoPermissionError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


class _ParserProxy:
    """A proxy of redis-py's command parser: what the parser has, as it has it (`Any`: the proxy
    passes for either parser, which redis-py's stubs cannot say)."""

    def __init__(self, parser: CommandsParser | AsyncCommandsParser):
        self._parser: Any = parser

    def __getattr__(self, name: str) -> Any:
        return getattr(self._parser, name)


class _KnownKeys(_ParserProxy):
    """redis-py's command parser, except for the commands of `known_keys`."""

    def get_keys(self, redis_conn: Any, *args: Any) -> list[Any] | None:
        return known_keys(args) or self._parser.get_keys(redis_conn, *args)


class _AsyncKnownKeys(_ParserProxy):
    """The asyncio command parser, except for the commands of `known_keys`."""

    async def get_keys(self, *args: Any) -> list[Any] | None:
        return known_keys(args) or await self._parser.get_keys(*args)


class Cluster(RedisCluster):
    """redis.cluster.RedisCluster, which reads the cluster's topology when it is made; `retry`
    paces the tries of a call (see the module's docstring)."""

    def __init__(self, *, retry: redis.retry.Retry | None = None, **kwargs: Any):
        self.pacing = _pacing(retry or redis.retry.Retry(NoBackoff(), 0))  # the topology is read at once
        with topology_errors():
            super().__init__(retry=redis.retry.Retry(NoBackoff(), 0), **kwargs)
        # Its pipelines share it. A proxy of the parser, which it passes for.
        self.commands_parser = cast(CommandsParser, _KnownKeys(self.commands_parser))
        forks.reset_after_fork(self)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        # RedisCluster's, by its class: mypy's untyped_calls_exclude (pyproject.toml) knows an
        # unannotated method of redis-py's by the class it is called on, not through super().
        return self.paced(lambda: RedisCluster.execute_command(self, *args, **kwargs))

    def after_fork_in_child(self) -> None:
        """redis-py's locks of the client, its nodes manager (one held for a whole topology
        refresh, one to read or swap its tables) and its load balancer, which a thread of the
        parent's may hold at the fork, made again. The nodes' pools see the fork themselves (their
        pid check)."""
        manager = self.nodes_manager
        self._lock = threading.RLock()
        manager._lock = threading.RLock()
        manager._initialization_lock = threading.RLock()
        manager.read_load_balancer._lock = threading.Lock()

    def paced(self, call: Callable[[], T]) -> T:
        """call(), tried again as `retry` allows while no node can serve it."""

        def attempt() -> T:
            with topology_errors():
                return call()

        return self.pacing.call_with_retry(attempt, lambda error: None)


class AsyncCluster(AsyncRedisCluster):
    """redis.asyncio.cluster.RedisCluster, which reads the topology at its first command."""

    def __init__(self, *, retry: redis.asyncio.retry.Retry | None = None, **kwargs: Any):
        self.pacing = _pacing(retry or redis.asyncio.retry.Retry(NoBackoff(), 0))
        super().__init__(retry=redis.asyncio.retry.Retry(NoBackoff(), 0), **kwargs)
        self.commands_parser = cast(AsyncCommandsParser, _AsyncKnownKeys(self.commands_parser))
        forks.reset_after_fork(self)

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await self.paced(lambda: super(AsyncCluster, self).execute_command(*args, **kwargs))

    def after_fork_in_child(self) -> None:
        """redis.asyncio's cluster nodes hold their connections themselves, with no pid check: in a
        forked child they are set aside, never closed (producer_client.forks), and the locks, maybe
        held by a task of the parent's loop, made again; the child connects its own."""
        manager = self.nodes_manager
        nodes = {id(node): node for node in (*manager.nodes_cache.values(), *manager.startup_nodes.values())}
        for node in nodes.values():
            forks.keep(list(node._connections))
            node._connections = []
            node._free.clear()
        self._lock = None
        self._usage_lock = asyncio.Lock()
        manager._initialize_lock = asyncio.Lock()

    async def paced(self, call: Callable[[], Awaitable[T]]) -> T:
        async def attempt() -> T:
            with topology_errors():
                return await call()

        async def ignore(error: Exception) -> None:
            pass

        return await self.pacing.call_with_retry(attempt, ignore)


def _pacing(retry: R) -> R:
    """`retry`, trying again on NODE_ERRORS too (redis-py's Retry knows connection errors only)."""
    retry.update_supported_errors(NODE_ERRORS)
    return retry


# A client MILI connects (producer_client.connection): of one server (a sentinel's master too), or
# of a cluster; synchronous or asyncio.
SyncRedis = redis.Redis | Cluster
AsyncRedis = redis.asyncio.Redis | AsyncCluster


def is_cluster(client: object) -> TypeIs[Cluster | AsyncCluster]:
    """Whether `client` is a cluster's (producer_client.connection makes every one a Cluster or an
    AsyncCluster). By its class: redis-py's clients are Protocols, whose isinstance() runs the
    typing module's Python checks (a microsecond at every round trip of every client and worker).
    The answer is kept per class: the clusters' classes are ABCs, whose issubclass() runs
    ABCMeta.__subclasscheck__, a Python call for each of the two, at every round trip."""
    cls = type(client)
    known = _CLUSTER_CLASSES.get(cls)
    if known is None:
        known = _CLUSTER_CLASSES[cls] = issubclass(cls, (Cluster, AsyncCluster))
    return known


_CLUSTER_CLASSES: dict[type, bool] = {}  # is_cluster's answers (a race only computes one twice)


def master_count(client: SyncRedis) -> int:
    """How many masters serve the slots `client` writes to: a cluster's, as of the topology it read
    last (redis-py reads CLUSTER SLOTS, so a master that serves no slot is not one); one server's, or
    a sentinel's master, 1. No round trip."""
    # RedisCluster's, by its class, for mypy's untyped_calls_exclude (see Cluster.execute_command).
    return len(RedisCluster.get_primaries(client)) if is_cluster(client) else 1
