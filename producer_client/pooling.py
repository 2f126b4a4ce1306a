"""The connection pools of MILI's clients and workers, synchronous and asyncio (of one server, or of
the master a sentinel names; a cluster's nodes keep redis-py's), and connections that connect once
per try.

redis-py's pool connects a connection as it hands it out, with the tries of the client's retry
policy, outside the call's own tries: a call's tries were its policy's plus the checkout's. And
its synchronous connection, lost in the middle of a call, is connected again at each of the
call's tries with the policy's tries once more where the socket's connect times out (a host gone
silent): (1 + retries) x retries connects. Here an exchange (producer_client.protocol.execution)
takes a connection as it is, and each of its tries connects it once if it is not: a call makes
1 + `retries` tries in all (connection.RETRIES), whatever fails.

The checkout and return of an exchange are a few attribute reads under the pool's lock and
redis-py's readiness check: 20 function calls (7 of Python) where redis-py's, with a deprecation
wrapper, metric records and an event dispatched at each return, were 72 (48), 4.6 us of a round
trip's CPU (bench/RESULTS.md, "A round trip's client side"). `max_connections` means what it
means in redis-py: connections open at once, each held by one call while it runs."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.connection
import redis.asyncio.sentinel
import redis.connection
import redis.sentinel
from redis.exceptions import ConnectionError, TimeoutError

from producer_client import forks

# What a connection's readiness check at its checkout may raise: it was closed by the server.
_CLOSED = (ConnectionError, TimeoutError, OSError)


class OncePerTry:
    """A connection that a send connects, once, if it is not: the call's retry policy spaces and
    counts the tries, where redis-py's send would try the socket's connect again within each."""

    _sock: Any

    def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self._sock:
            # Called by their class, not through super(): see connection.py's note on redis-py's classes.
            redis.connection.AbstractConnection.connect_check_health(
                self,  # type: ignore[arg-type]
                check_health=False,
                retry_socket_connect=False,
            )
        redis.connection.AbstractConnection.send_packed_command(self, command, check_health)  # type: ignore[arg-type]


class Connection(OncePerTry, redis.connection.Connection):
    pass


class SSLConnection(Connection, redis.connection.SSLConnection):
    pass


class UnixConnection(OncePerTry, redis.connection.UnixDomainSocketConnection):
    pass


# The connection of each kind redis-py makes of a URL (its parse_url's connection_class), connected once per try.
ONCE_PER_TRY: dict[type, type] = {
    redis.connection.Connection: Connection,
    redis.connection.SSLConnection: SSLConnection,
    redis.connection.UnixDomainSocketConnection: UnixConnection,
}


class ExchangePool(redis.ConnectionPool):
    """redis-py's pool, with a checkout (`take`) and a return (`give_back`) for an exchange: the
    connection as it is (each try of the exchange connects it), and none of redis-py's per-call
    records (its connection-count metrics, which MILI does not enable)."""

    def take(self) -> Any:
        """The last connection returned (a free list's top: the one most likely warm), or a new one,
        not connected; MaxConnectionsError past max_connections, as redis-py's. One its server
        closed is disconnected first, so the exchange's first try connects it afresh: redis-py's
        readiness check, as its checkout makes it (data waiting counts as dirty only where its
        maintenance notifications are off; an exchange that fails closes its connection)."""
        if self.pid != os.getpid():
            self._checkpid()  # forked: the parent's connections are not ours
        with self._lock:
            free = self._available_connections
            connection: Any = free.pop() if free else self.make_connection()
            self._in_use_connections.add(connection)
        if connection._sock is not None:
            try:
                # The parser's can_read, not the connection's, which adds a connect (it is connected)
                # and its host's name for an error message that _CLOSED drops: 3 Python calls of
                # every exchange. With a client-side cache, data waiting is its invalidations: only
                # a closed connection (the connection's check raises) is dirty.
                if self.cache is None:
                    dirty = connection._parser.can_read(0) and not self._pushes()
                else:
                    connection.can_read()
                    dirty = False
            except _CLOSED:
                dirty = True
            except BaseException:  # interrupted: not lost to the pool
                self.give_back(connection)
                raise
            if dirty:
                connection.disconnect()
        return connection

    def _pushes(self) -> bool:
        """Whether the server may send what nobody asked for (RESP3's maintenance notifications):
        then a connection with data to read is no dirty one, as redis-py's checkout has it."""
        return bool(redis.ConnectionPool.maint_notifications_enabled(self))

    def give_back(self, connection: Any) -> None:
        """Return what `take` gave, as redis-py's release does, less its records: a connection this
        pool no longer owns (its process forked; under Sentinel, one to a master no longer named)
        is closed instead, and a streaming credential's new token is sent (re_auth)."""
        if self.pid != os.getpid():
            self.release(connection)
            return
        with self._lock:
            try:
                self._in_use_connections.remove(connection)
            except KeyError:  # none of this pool's (as redis-py's release, which passes it over)
                return
            if not self.owns_connection(connection):
                connection.disconnect()
                self._created_connections -= 1
                return
            if connection.should_reconnect():
                connection.disconnect()
            self._available_connections.append(connection)
        connection.re_auth()


class SentinelPool(ExchangePool, redis.sentinel.SentinelConnectionPool):
    """ExchangePool, of the master a sentinel names."""


class AsyncOncePerTry:
    """OncePerTry, for asyncio."""

    is_connected: bool

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        if not self.is_connected:
            await redis.asyncio.connection.AbstractConnection.connect_check_health(
                self,  # type: ignore[arg-type]
                check_health=False,
                retry_socket_connect=False,
            )
        await redis.asyncio.connection.AbstractConnection.send_packed_command(
            self,  # type: ignore[arg-type]
            command,
            check_health,
        )


class AsyncConnection(AsyncOncePerTry, redis.asyncio.connection.Connection):
    pass


class AsyncSSLConnection(AsyncConnection, redis.asyncio.connection.SSLConnection):
    pass


class AsyncUnixConnection(AsyncOncePerTry, redis.asyncio.connection.UnixDomainSocketConnection):
    pass


ASYNC_ONCE_PER_TRY: dict[type, type] = {
    redis.asyncio.connection.Connection: AsyncConnection,
    redis.asyncio.connection.SSLConnection: AsyncSSLConnection,
    redis.asyncio.connection.UnixDomainSocketConnection: AsyncUnixConnection,
}


class AsyncExchangePool(redis.asyncio.ConnectionPool):
    """ExchangePool, for asyncio."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        forks.reset_after_fork(self)

    def after_fork_in_child(self) -> None:
        set_aside(self)

    async def take(self) -> Any:
        async with self._lock:
            connection: Any = redis.asyncio.ConnectionPool.get_available_connection(self)
        if connection.is_connected:
            try:
                dirty = await connection.can_read() and not self._pushes()
            except _CLOSED:
                dirty = True
            except BaseException:  # cancelled: not lost to the pool
                await self.give_back(connection)
                raise
            if dirty:
                await connection.disconnect()
        return connection

    def _pushes(self) -> bool:
        return bool(redis.asyncio.ConnectionPool.maint_notifications_enabled(self))

    async def give_back(self, connection: Any) -> None:
        """redis-py's release, less its records."""
        async with self._lock:
            self._in_use_connections.remove(connection)
            if connection.should_reconnect():
                await connection.disconnect()
            self._available_connections.append(connection)
        await connection.re_auth()


def set_aside(pool: redis.asyncio.ConnectionPool) -> None:
    """In a forked child, empties an asyncio pool: redis.asyncio's pools have no pid check, and the
    child would send its commands over the parent's sockets and read the parent's replies. The
    connections, of the parent's event loop, are kept, never closed (producer_client.forks); the
    child connects its own. Its lock may be held by a task of the parent's loop."""
    forks.keep(list(pool._available_connections), list(pool._in_use_connections))
    pool.reset()
    pool._lock = asyncio.Lock()


class AsyncSentinelPool(AsyncExchangePool, redis.asyncio.sentinel.SentinelConnectionPool):
    """AsyncExchangePool, of the master a sentinel names."""


# The pools whose connections an exchange takes as they are (`take`): redis-py's own, such as a test's
# client's, are checked out as redis-py does it (get_connection, which connects). By their exact
# types: isinstance() of a redis-py pool runs the abc module's Python checks at every round trip.
EXCHANGE_POOLS = frozenset({ExchangePool, SentinelPool})
ASYNC_EXCHANGE_POOLS = frozenset({AsyncExchangePool, AsyncSentinelPool})
