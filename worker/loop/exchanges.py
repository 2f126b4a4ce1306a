"""The loop's exchanges with Redis, one at a time, and what a failed one means. A transient failure
(connection lost, Redis loading, out of memory or read-only) marks the link down, and the loop
tries again with backoff (RedisLink); a refusal no job's failure explains is logged at each try
and retried the same way; a lost consumer group is created again before the next read. Around
an outage, and after a stall, reclaims wait claim_idle_ms (Admission.defer_reclaims)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from producer_client.connection import is_fatal
from worker.loop.admission import Admission
from worker.loop.context import LoopContext
from worker.loop.ownership import Ownership
from worker.loop.queue import GroupLost, RedisLink, is_transient

log = logging.getLogger(__name__)


class Exchanges:
    def __init__(
        self,
        ctx: LoopContext,
        admission: Admission,
        ownership: Ownership,
        pause_point: Callable[[], None] | None,
    ):
        self.settings, self.holdings, self.metrics = ctx.settings, ctx.holdings, ctx.metrics
        self.admission, self.ownership = admission, ownership
        self.pause_point = pause_point  # see Worker
        self.link = RedisLink(ctx.settings.redis_backoff_max_s)
        self.last = time.monotonic()

    @property
    def up(self) -> bool:
        return self.link.up

    def ready(self) -> bool:
        """Redis answered the last exchange, or is due for another try."""
        return self.link.ready()

    def wait_to_retry(self, at_most_s: float) -> None:
        self.link.wait(at_most_s)

    def run(self, talk: Callable[[], None]) -> None:
        """Run one exchange with Redis. A transient failure (connection lost, Redis loading, out
        of memory or read-only) marks the link down: everything sent is safe to send again, and
        what was not acknowledged stays in the outbox, the receipts or the pending list. A lost
        consumer group is created again before the next read, and the jobs held here adopted."""
        if self.pause_point is not None:
            self.pause_point()
        buffered = 0 if self.link.up else self.holdings.unpublished_tokens()
        if not self.link.up or self._was_away():
            # Not in this exchange either, should Redis answer now: see below. A worker that has
            # not talked to Redis for longer than any step may take (it stalled) knows as little:
            # Redis may have restarted meanwhile, and the other workers be refreshing their
            # entries only now.
            self.admission.defer_reclaims()
        try:
            talk()
        except GroupLost as e:
            self.ownership.group_lost(e)
        except redis.RedisError as e:
            if is_fatal(e):
                raise
            if not is_transient(e):
                self._refused(e)
            self.link.failed(e, quiet=not is_transient(e))
            self.metrics.redis_answered(False)
            return
        finally:
            self.last = time.monotonic()
        self.metrics.redis_answered(True)
        down_s = self.link.succeeded()
        if down_s is not None:
            log.info("Redis is back after %.1fs; %d tokens were buffered meanwhile", down_s, buffered)
            # Entries of every worker look idle after an outage of all of them (a Redis restart):
            # reclaim nothing until the live ones have had claim_idle_ms to refresh theirs.
            self.admission.defer_reclaims()

    def _refused(self, error: redis.RedisError) -> None:
        """An error no job's failure explains (those are charged to their jobs: rejection.py): a
        key of the queue of another type (producers may write it), or a bug. No producer can
        stop a worker: it keeps its jobs and tries again with backoff, as after an outage, and says
        so at each try (they slow to one every redis_backoff_max_s) until an operator puts it right."""
        log.error("Redis refused an exchange: %s: %s; trying again with backoff", type(error).__name__, error)

    def _was_away(self) -> bool:
        """Longer since the last exchange than claim_idle_ms allows a step and a heartbeat."""
        away_s = time.monotonic() - self.last
        return away_s > self.settings.claim_idle_ms / 1000 - self.settings.heartbeat_interval_s
