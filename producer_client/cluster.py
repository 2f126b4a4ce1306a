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

from collections.abc import Sequence
from typing import Literal, cast

import redis
import redis.asyncio.retry
import redis.retry
from redis._parsers import AsyncCommandsParser, CommandsParser
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, SlotNotCoveredError

SCRIPT_CALLS = frozenset({"EVAL", "EVALSHA"})
STREAM_READS = frozenset({"XREAD", "XREADGROUP"})
# What a failover or a resharding answers until the cluster serves every slot again.
NODE_ERRORS = (redis.ConnectionError, redis.TimeoutError, ClusterDownError)


def known_keys(args: Sequence) -> list | None:
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


class topology_errors:
    """Raise a cluster that cannot be used now as a RedisError (see the module's docstring). A class
    rather than a @contextmanager: every pipeline of a client and a worker goes through it, and a
    generator-based one costs four more Python calls each time."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, traceback) -> Literal[False]:
        if not isinstance(e, RedisClusterException):
            return False
        if isinstance(e.__cause__, redis.RedisError):
            raise e.__cause__ from None  # e.g. "cannot be connected", from the ConnectionError behind it
        if isinstance(e, SlotNotCoveredError) or str(e).startswith("All slots are not covered"):
            raise ClusterDownError(str(e)) from e
        return False


class _KnownKeys:
    """redis-py's command parser, except for the commands of `known_keys`."""

    def __init__(self, parser):
        self._parser = parser

    def __getattr__(self, name: str):
        return getattr(self._parser, name)

    def get_keys(self, redis_conn, *args):
        return known_keys(args) or self._parser.get_keys(redis_conn, *args)


class _AsyncKnownKeys(_KnownKeys):
    async def get_keys(self, *args):
        return known_keys(args) or await self._parser.get_keys(*args)


class Cluster(RedisCluster):
    """redis.cluster.RedisCluster, which reads the cluster's topology when it is made; `retry`
    paces the tries of a call (see the module's docstring)."""

    def __init__(self, *, retry: redis.retry.Retry | None = None, **kwargs):
        self.pacing = _pacing(retry or redis.retry.Retry(NoBackoff(), 0))  # the topology is read at once
        with topology_errors():
            super().__init__(retry=redis.retry.Retry(NoBackoff(), 0), **kwargs)
        # Its pipelines share it. A proxy of the parser, which it passes for.
        self.commands_parser = cast(CommandsParser, _KnownKeys(self.commands_parser))

    def execute_command(self, *args, **kwargs):
        return self.paced(lambda: super(Cluster, self).execute_command(*args, **kwargs))

    def paced(self, call):
        """call(), tried again as `retry` allows while no node can serve it."""

        def attempt():
            with topology_errors():
                return call()

        return self.pacing.call_with_retry(attempt, lambda error: None)


class AsyncCluster(AsyncRedisCluster):
    """redis.asyncio.cluster.RedisCluster, which reads the topology at its first command."""

    def __init__(self, *, retry: redis.asyncio.retry.Retry | None = None, **kwargs):
        self.pacing = _pacing(retry or redis.asyncio.retry.Retry(NoBackoff(), 0))
        super().__init__(retry=redis.asyncio.retry.Retry(NoBackoff(), 0), **kwargs)
        self.commands_parser = cast(AsyncCommandsParser, _AsyncKnownKeys(self.commands_parser))

    async def execute_command(self, *args, **kwargs):
        return await self.paced(lambda: super(AsyncCluster, self).execute_command(*args, **kwargs))

    async def paced(self, call):
        async def attempt():
            with topology_errors():
                return await call()

        async def ignore(error):
            pass

        return await self.pacing.call_with_retry(attempt, ignore)


def _pacing(retry):
    """`retry`, trying again on NODE_ERRORS too (redis-py's Retry knows connection errors only)."""
    retry.update_supported_errors(NODE_ERRORS)
    return retry


def is_cluster(client) -> bool:
    return isinstance(client, (RedisCluster, AsyncRedisCluster))
