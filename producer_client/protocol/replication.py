"""How many replicas must confirm a write before it counts as made: the clients' `wait_replicas`
and the worker's setting of the same name (its results), sent as WAIT by
`execution.Commands.wait_replicas`."""

from __future__ import annotations

from dataclasses import dataclass

from producer_client.errors import InvalidArgument

REDIS_PY_SOCKET_TIMEOUT_S = 5.0  # redis-py's socket_timeout where the URL sets none


@dataclass(frozen=True)
class Replication:
    """How many replicas must confirm a write (WAIT) before it counts as made, and how long to
    wait for them. 0 replicas: no wait; Redis acknowledges a write once its master has it."""

    replicas: int = 0
    timeout_ms: int = 1000

    def __post_init__(self) -> None:
        for name, least in (("replicas", 0), ("timeout_ms", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InvalidArgument(f"wait_{name}", f"must be an integer of at least {least}")

    @property
    def waits(self) -> bool:
        return self.replicas > 0

    def check_within(self, socket_timeout_s: float | None) -> None:
        """Refuses a WAIT as long as the connection's socket timeout, or longer: its reply would come
        after the client stopped reading, the retry policy would send the whole enqueue again (up to
        ten times, a stream entry each), and the submit would end in RedisTimedOut after a minute
        with its clean-up deleting a job whose entries are in the stream, never NotReplicated."""
        timeout_s = REDIS_PY_SOCKET_TIMEOUT_S if socket_timeout_s is None else socket_timeout_s
        if self.waits and self.timeout_ms >= timeout_s * 1000:
            raise InvalidArgument(
                "wait_timeout_ms",
                f"must be shorter than the connection's socket_timeout ({timeout_s:g} s; the URL's "
                "?socket_timeout= sets it)",
            )
