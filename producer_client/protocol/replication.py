"""How many replicas must confirm a write before it counts as made: the clients' `wait_replicas`
and the worker's setting of the same name (its results), sent as WAIT by
`execution.Commands.wait_replicas`."""

from __future__ import annotations

from dataclasses import dataclass

from producer_client.errors import InvalidArgument


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
