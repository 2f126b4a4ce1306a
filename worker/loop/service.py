"""The queue loop: read -> admit -> step -> publish -> ack, until told to stop.

One iteration refreshes what the worker holds (ownership.py), takes only as many entries as the
engine can start now, reclaimed ones first, and claims them (admission.py); runs one engine step
and adds its outputs to the jobs; then settles the publication round Redis has answered and hands
the next to the publisher's thread (publication.py), which the next step does not wait for: each
job's output goes out when it is due (pace.py), its end at once, all due jobs in one pipeline.
An entry is acknowledged (and deleted) only after its final result is in Redis: at-least-once
delivery. Each claim starts a new run of the job whose token fences off every earlier run, so a
job's events and its one result come from one run at a time; a reclaimed job continues from the
tokens its event stream recorded.

Four kinds of trouble stay inside the loop. Redis unavailable (unreachable, loading, out of
memory, read-only during a failover): the engine keeps stepping, what Redis has not seen waits in
the outbox (generation pauses once it holds max_buffered_tokens), and the loop tries again with
backoff (exchanges.py). Redis having lost the queue's consumer group (it restarted empty, or was flushed): the
loop creates the group again and adopts the jobs it holds, which run on to their results. An
engine step that raises: its jobs leave the engine and come back one per step, so the job that
makes a step fail is found and fails alone (isolation.py). A Redis error met on one job's keys
(a producer may write them: a key of another type, a field no script reads) fails that job alone
(rejection.py); any other refusal is retried with backoff. Only wrong credentials and an ACL that
forbids a command stop the worker.

Every time the worker writes or compares (deadlines, timings, heartbeats) is on Redis's clock
(RedisClock): producers, workers and Redis need not agree on the time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from producer_client import steps
from producer_client.cluster import SyncRedis, master_count
from producer_client.connection import is_fatal
from producer_client.keys import Keys
from producer_client.protocol.execution import AddCommands
from producer_client.protocol.replication import Replication
from producer_client.protocol.shards import serving_count
from worker.engine.interface import EngineAPI
from worker.engine.outputs import RequestOutput
from worker.loop.admission import FLEX, Admission
from worker.loop.collection import Collector
from worker.loop.context import LoopContext
from worker.loop.exchanges import Exchanges
from worker.loop.flex_pace import FlexPace
from worker.loop.holdings import Holdings
from worker.loop.intake import Delivery
from worker.loop.isolation import EngineError, FailureIsolation
from worker.loop.job_commands import JobCommands
from worker.loop.ownership import Ownership
from worker.loop.pace import Pace
from worker.loop.placement import TakeOver
from worker.loop.publication import Publication
from worker.loop.queue import GroupLost, RedisClock, is_transient
from worker.loop.rejection import Rejections
from worker.loop.streams import owner_of
from worker.loop.worker_queue import WorkerQueue
from worker.metrics import WorkerMetrics
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

NO_ROOM = (0, 0, 0)


class Worker:
    def __init__(
        self,
        engine: EngineAPI,
        client: SyncRedis,
        settings: WorkerSettings,
        metrics: WorkerMetrics,
        name: str,
        device: str = "cpu",
        metrics_port: int | None = None,
        clock: RedisClock | None = None,
        pause_point: Callable[[], None] | None = None,
        timer: Callable[[], float] = time.perf_counter,
    ):
        """`pause_point`: called in the loop's thread before each exchange with Redis and each engine
        step, the seam where a test holds the worker (a stall) or stops it for good between two of
        its moves, as kill -9 would (harness/echo_workers.py). None in production. `timer`: what
        the flex pace measures steps and admissions with (flex_pace.py), a test's own clock."""
        self.engine = engine
        self.pause_point = pause_point
        self.settings = settings
        self.metrics = metrics
        self.name = name
        clock = clock or RedisClock()
        self.clock = clock
        replication = Replication(settings.wait_replicas, settings.wait_timeout_ms)
        keys = Keys(settings.prefix)
        shards = steps.run(client, serving_count(keys, settings.queue, settings.queue_shards, master_count(client)))
        self.queue = WorkerQueue(
            client,
            keys,
            settings.queue,
            name,
            clock,
            placed=settings.placement,
            poll_ms=settings.placement_poll_ms,
            shards=shards,
        )
        job_commands = JobCommands(client, keys, name, settings.result_ttl_s, replication)
        self.holdings = Holdings(engine)
        ctx = LoopContext(name, settings, engine, self.queue, job_commands, clock, metrics, self.holdings)
        self.rejections = Rejections(ctx)
        self.admission = Admission(ctx, self.rejections)
        self.take_over = TakeOver(ctx, self.admission)
        self.isolation = FailureIsolation(ctx, self.admission)
        pace = Pace(settings.stream_interval_s, settings.checkpoint_interval_s, settings.engine.max_running)
        self.collector = Collector(ctx, self.isolation, pace)
        self.publication = Publication(ctx, self.rejections, pace)
        self.ownership = Ownership(ctx, self.rejections, device, metrics_port)
        self.exchanges = Exchanges(ctx, self.admission, self.ownership, pause_point)
        self.flex_pace = FlexPace(timer)
        self.drain_deadline: float | None = None
        self.stop_now = False
        self.paused = False  # generation waits for the outbox to drain

    # -- lifecycle -------------------------------------------------------------------------

    def serve(self) -> None:
        log.info("serving queue %r as %s (%d KV pages)", self.settings.queue, self.name, self.ownership.total_pages)
        try:
            while self._should_run():
                self._iterate()
            self._hand_over()
        finally:
            self.publication.close()
            self.queue.reads.close()
            try:
                self.queue.members.leave()
            except redis.RedisError as e:  # do not hide why the loop ended
                log.warning("could not remove the heartbeat: %s", e)

    def request_stop(self) -> None:
        """First call (SIGTERM): stop reading, give running jobs drain_grace_s to finish and hand
        the rest over to other workers. Second call: stop now (and still hand over)."""
        if self.drain_deadline is None:
            self.drain_deadline = time.monotonic() + self.settings.drain_grace_s
            log.info("draining: %d running jobs, %.0fs grace", len(self.holdings.running), self.settings.drain_grace_s)
        else:
            self.stop_now = True

    def _should_run(self) -> bool:
        if self.stop_now:
            return False
        if self.drain_deadline is None:
            return True
        if not (self.engine.has_unfinished() or self.holdings.unsettled() or self.publication.busy):
            return False
        return time.monotonic() < self.drain_deadline

    def _hand_over(self) -> None:
        """The end of a drain: publish what Redis has not seen, acknowledge, and hand the entries
        of unfinished jobs over to other workers, which resume them from their recorded tokens."""
        try:
            try:
                self._publish_and_give_back()
            except GroupLost:
                self.ownership.restore_group()  # every job held here is detached now: give them back anew
                self._publish_and_give_back()
        except redis.RedisError as e:
            if is_fatal(e):
                raise
            log.warning(
                "Redis unreachable at the end (%s): %d unfinished jobs wait claim_idle_ms to be reclaimed, and "
                "%d tokens not yet published will be generated again",
                e,
                len(self.holdings.entries()),
                self.holdings.unpublished_tokens(),
            )

    def _publish_and_give_back(self) -> None:
        self.publication.flush()
        self.rejections.send()
        corrections = dict(self.holdings.ledger.owed)
        self.queue.reads.read(NO_ROOM, None, *self.holdings.receipts(), corrections)
        self.holdings.receipts_sent(corrections)
        self._give_back_unfinished()

    def _give_back_unfinished(self) -> None:
        """Held entries become claimable at once (RELEASE); detached jobs, which have no entry,
        go back to the queue as new entries (REQUEUE)."""
        held = list(self.holdings.entries())
        if held:
            released = self.queue.members.release(held)
            log.info("handed %d unfinished jobs over to other workers", released)
        for job in self.holdings.detached():
            try:
                requeued = self.queue.members.requeue(job)
            except redis.ResponseError as e:
                if is_transient(e) or is_fatal(e):
                    raise
                self.rejections.of_job(job, e)  # its keys refused REQUEUE
                continue
            if requeued:
                log.info("job %s: detached from its lost entry, enqueued anew for another worker", job.id)
        self.rejections.send()

    # -- one iteration -----------------------------------------------------------------------

    def _iterate(self) -> None:
        if self.exchanges.ready():
            self.exchanges.run(self._receive)
        stepped = self._step_if_possible()
        if self.exchanges.ready():
            self.exchanges.run(self.publication.publish)
        if not stepped:
            self._wait_for_redis()

    def _wait_for_redis(self) -> None:
        """Nothing to step: rather than spin, wait for Redis to be due for another try, or for the
        publication round out to be answered, and settle it."""
        if not self.exchanges.up:
            self.exchanges.wait_to_retry(self.settings.block_ms / 1000)
        elif self.publication.busy:
            self.exchanges.run(lambda: self.publication.settle_out(self.settings.block_ms / 1000))

    def _receive(self) -> None:
        if self.ownership.group_missing:
            self._settle_out_for_adoption()
            self.ownership.restore_group()
        self.rejections.send()  # their entries are acknowledged with the read below
        self.ownership.heartbeat_if_due("serving" if self.drain_deadline is None else "draining")
        self._take_idle_entries()
        idle = not (self.engine.has_unfinished() or self.holdings.unadmitted or self.holdings.has_updates())
        block_ms = max(1, min(self.settings.block_ms, self.ownership.ms_to_heartbeat())) if idle else None
        corrections = dict(self.holdings.ledger.owed)
        rooms = self._rooms()
        flex_batch = self.flex_pace.batch(self._higher_lanes_held())
        read = self.queue.reads.read(rooms, block_ms, *self.holdings.receipts(), corrections, flex_batch)
        self.holdings.receipts_sent(corrections)
        self._take(read)
        # Flex entries read count as room for the higher lanes (the engine preempts them), so the
        # rooms of those lanes are what they were before the read. Admission sends the look only
        # where every entry it claims is flex.
        look = self.queue.reads.higher_lanes_look(rooms) if read else None
        if self._admit_timed(look):
            self._take(self.queue.reads.read_higher_lanes(rooms))
            self.admission.admit()

    def _higher_lanes_held(self) -> bool:
        """Whether a job of a lane above flex (default, priority) is held."""
        return any(count > 0 for lane, count in self.holdings.running_lanes.items() if lane != FLEX)

    def _admit_timed(self, look: AddCommands | None) -> bool:
        """Admission.admit, its time given to the flex pace when every entry admitted is flex."""
        unadmitted = self.holdings.unadmitted
        flex = all(d.route.lane == FLEX for d in unadmitted)
        started = self.flex_pace.timer()
        found = self.admission.admit(look)
        if flex:
            self.flex_pace.admitted(len(unadmitted), self.flex_pace.timer() - started)
        return found

    def _take(self, read: list[Delivery]) -> None:
        """Entries read, held until admitted (most iterations of a full worker read nothing)."""
        if read:
            own = sum(1 for d in read if owner_of(d.entry_id) is not None)
            self.metrics.taken["own"].inc(own)
            self.metrics.taken["shared"].inc(len(read) - own)
        self.holdings.take(read)

    def _settle_out_for_adoption(self) -> None:
        """Adoption replaces the jobs' updates: none may be out. A round sent after the loss
        reports it again (GroupLost: its jobs' hashes are gone), its updates kept for the adoption
        all the same (Publication._settle): raised, it stopped the adoption, and a round out at
        each iteration (one is sent at most iterations of a busy worker) stopped it for ever."""
        try:
            self.publication.settle_out()
        except GroupLost:
            pass  # the loss being mended

    def _take_idle_entries(self) -> None:
        """Entries of dead or stalled workers, in the shared stream and in every worker's own; and
        entries placed on a busy worker that waited longer than steal_delay_ms. A full worker (most
        iterations of a busy one) has no room: neither the reclaim nor the scan takes anything."""
        room = self._room()
        if room <= 0:
            return
        taken = len(self.holdings.unadmitted)
        self.admission.reclaim(room)
        reclaimed = len(self.holdings.unadmitted) - taken
        if reclaimed:  # a counter's inc takes a lock and five Python calls, even of 0
            self.metrics.taken["reclaimed"].inc(reclaimed)
        self.take_over.scan(room - reclaimed)  # what _room() counts now: the entries reclaimed are held

    def _room(self) -> int:
        """Room for any lane: _rooms()'s last, without counting the jobs held of each lane (a full
        worker's iteration asks this twice and most iterations take nothing)."""
        return self.admission.room() if self._takes_jobs() else 0

    def _rooms(self) -> tuple[int, int, int]:
        """Room for each lane (Admission.rooms)."""
        return self.admission.rooms() if self._takes_jobs() else NO_ROOM

    def _takes_jobs(self) -> bool:
        """Whether this worker takes jobs now: not while draining, nor while suspects of a failed
        step are tried one at a time."""
        return self.drain_deadline is None and not self.isolation.busy

    # -- step ---------------------------------------------------------------------------------

    def _step_if_possible(self) -> bool:
        """One engine step, unless the engine has nothing to do or the outbox is full (Redis has
        been unreachable for a while: generation waits, the jobs stay in the engine)."""
        if self.pause_point is not None:
            self.pause_point()
        if self.holdings.unpublished_reach(self.settings.max_buffered_tokens):
            if not self.paused:
                log.warning(
                    "%d tokens await publication: generation pauses until Redis takes them",
                    self.holdings.unpublished_tokens(),
                )
            self.paused = True
            return False
        self.paused = False
        self.isolation.try_next_suspect()
        if not self.engine.has_unfinished():
            return False
        self._stop_overdue()
        self.collector.collect(self._step())
        if self.exchanges.up:
            self.queue.reads.look_ahead()
        return True

    def _stop_overdue(self) -> None:
        """Every running job past its deadline is stopped. Asked before every step, of the running
        jobs that have a deadline (Holdings.timed: a job without a timeout has none), by a list
        comprehension; most deadlines are far off."""
        now = self.clock.now()
        overdue = [job for job in self.holdings.timed.values() if now > job.deadline]  # type: ignore[operator]
        for job in overdue:
            if job.stop_reason is None:
                self.holdings.stop(job, "timeout")

    def _step(self) -> list[RequestOutput]:
        try:
            started = self.flex_pace.timer()
            outputs = self.engine.step()
            self.flex_pace.stepped(self.flex_pace.timer() - started)
            return outputs
        except Exception as e:
            log.exception("an engine step of %d jobs failed", len(self.holdings.running))
            self.isolation.isolate(EngineError(f"{type(e).__name__}: {e}"))
            return []
