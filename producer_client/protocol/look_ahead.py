"""A full worker's look for priority jobs (consumer.add_lanes_active's EXISTS) sent ahead of its
answer: written on a connection of its own and read back later, so that the round trip runs while
the worker does other work instead of as an exchange it waits on (bench/RESULTS.md, "A whole-read
token's loop"). One server only: on a cluster the lanes of several shards lie on several nodes."""

from __future__ import annotations

from typing import Any

import redis
from hiredis import pack_command

from producer_client.pooling import EXCHANGE_POOLS


class LookAhead:
    """EXISTS of `lanes`: `send` writes it and returns at once, `answer` reads its reply (whether a
    priority job waits unread, as the lanes stood when it was sent). A failure of either closes the
    connection and gives no answer (None): the caller then looks the usual way, an exchange that
    meets the failure as every other does, so nothing here needs an outage's handling."""

    def __init__(self, client: redis.Redis, lanes: list[str]):
        self.pool: Any = client.connection_pool
        command: tuple[Any, ...] = ("EXISTS", *lanes)
        self.packed = [pack_command(command)]  # packed once; send_packed_command takes a list of buffers
        self.connection: Any = None
        self.sent = False

    def send(self) -> None:
        """Write the look, unless one is out already (its answer not read yet)."""
        if self.sent:
            return
        try:
            if self.connection is None:
                self.connection = self._take()
            self.connection.send_packed_command(self.packed, check_health=False)
            self.sent = True
        except redis.RedisError:
            self.close()

    def answer(self) -> bool | None:
        """The reply of the look out, read now (it waits for it if Redis has not answered yet); None
        when none is out or it failed."""
        if not self.sent:
            return None
        self.sent = False
        try:
            return int(self.connection.read_response()) > 0
        except redis.RedisError:
            self.close()
            return None

    def close(self) -> None:
        """Let go of the connection (a reply left unread with it): the next send takes another."""
        connection, self.connection, self.sent = self.connection, None, False
        if connection is None:
            return
        connection.disconnect()
        if type(self.pool) in EXCHANGE_POOLS:
            self.pool.give_back(connection)
        else:
            self.pool.release(connection)

    def _take(self) -> Any:
        return self.pool.take() if type(self.pool) in EXCHANGE_POOLS else self.pool.get_connection()
