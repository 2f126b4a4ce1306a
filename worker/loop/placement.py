"""The worker's side of cache-aware placement (docs/architecture.md): what it advertises in its
heartbeat so that producers place jobs on it, and how a worker with room takes over the entries
placed on other workers that wait too long (a steal: their owner is busy, stalled or gone) or that
a dead or stalled owner held (a reclaim, as on the shared stream). Reading its own stream before
the shared one is QueueReads.read's."""

from __future__ import annotations

import logging
import time

import redis

from producer_client.connection import is_fatal
from worker.engine.interface import EngineAPI
from worker.loop.admission import Admission, log_reclaimed
from worker.loop.context import LoopContext
from worker.loop.holdings import Holdings
from worker.loop.intake import Delivery
from worker.loop.queue import is_transient
from worker.loop.streams import owner_of
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def advertised(settings: WorkerSettings, holdings: Holdings, worker: str) -> dict[str, int]:
    """Heartbeat fields a producer places by: whether this worker reads a stream of its own, its
    slots, and how many of the entries it holds are in that stream (the rest of the stream's
    length is what waits there); and that it reads the lanes (a placed entry's route: producers
    place only on workers that do)."""
    if not settings.placement:
        return {"placement": 0, "lanes": 1}
    own = sum(1 for ref in holdings.entries() if owner_of(ref) == worker)
    return {"placement": 1, "lanes": 1, "slots": settings.engine.max_running, "placed_held": own}


def adapters_advertised(engine: EngineAPI) -> dict[str, str]:
    """Heartbeat fields of a worker that serves LoRA adapters: the names it serves (what a producer
    and the gateway check a job's adapter against, and route by) and those it holds in memory now
    (a job naming one loads nothing), comma-separated."""
    adapters = engine.adapters()
    if adapters is None:
        return {}
    served, held = adapters
    return {"adapters": ",".join(served), "adapters_held": ",".join(held)}


class TakeOver:
    """Looks at every worker's own stream while this worker has room: at most every
    reclaim_interval_s, and twice per steal_delay_ms, so that an entry waits at most about
    1.5 x steal_delay_ms for a worker with room."""

    def __init__(self, ctx: LoopContext, admission: Admission):
        self.queue, self.holdings, self.settings = ctx.queue, ctx.holdings, ctx.settings
        self.clock, self.metrics = ctx.clock, ctx.metrics
        self.admission = admission
        self.interval_s = min(ctx.settings.reclaim_interval_s, ctx.settings.steal_delay_ms / 2000)
        self.next_scan = 0.0

    def scan(self, room: int) -> None:
        now = time.monotonic()
        if room <= 0 or now < self.next_scan:
            return
        self.next_scan = now + self.interval_s
        # Steals need no wait after an outage, unlike reclaims: an entry nobody has read is nobody's.
        steal_before_ms = int(self.clock.now() * 1000) - self.settings.steal_delay_ms
        min_idle_ms = self.admission.min_idle_ms()
        reclaimed, stolen = self._take(room, min_idle_ms, steal_before_ms)
        log_reclaimed(reclaimed, min_idle_ms, " of workers' own streams")
        if stolen:
            log.info(
                "stole %d entries unread for over %d ms: %s",
                len(stolen),
                self.settings.steal_delay_ms,
                ", ".join(f"{d.job_id} (placed on {owner_of(d.entry_id)})" for d in stolen),
            )
        self.metrics.taken["reclaimed"].inc(len(reclaimed))
        self.metrics.taken["stolen"].inc(len(stolen))
        self.holdings.take(reclaimed + stolen)

    def _take(self, room: int, min_idle_ms: int, steal_before_ms: int) -> tuple[list[Delivery], list[Delivery]]:
        """From the stream of every worker in the queue's index, this one's too (an earlier process
        of the same name may have died holding entries), until `room` are taken: one pipeline asks
        every stream whether it has anything to take (TAKEABLE), then TAKE_OVER goes to those that
        do, one at a time. Steals are from others only: this worker reads its own stream anyway. A
        stream that refuses (a producer wrote it) is passed over; the next scan tries again."""
        reclaimed: list[Delivery] = []
        stolen: list[Delivery] = []
        owners = list(self.queue.members.peers)
        if not owners:
            return reclaimed, stolen
        before = {owner: 0 if owner == self.queue.worker else steal_before_ms for owner in owners}
        answers = self.queue.reclaims.takeable(owners, min_idle_ms, before)
        for owner, answer in zip(owners, answers):
            left = room - len(reclaimed) - len(stolen)
            if left <= 0:
                break
            if isinstance(answer, Exception):
                log.warning("could not look at the stream of worker %s: %s", owner, answer)
                continue
            if not answer:
                continue
            try:
                taken = self.queue.reclaims.take_over(owner, left, min_idle_ms, before[owner])
            except redis.ResponseError as e:
                if is_transient(e) or is_fatal(e):
                    raise
                log.warning("could not look at the stream of worker %s: %s", owner, e)
                continue
            reclaimed += taken[0]
            stolen += taken[1]
        return reclaimed, stolen
