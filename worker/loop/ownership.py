"""Ownership: a worker keeps every entry it holds from being reclaimed, however long its jobs
run, by refreshing them with each heartbeat; learns from the refresh which ones another worker
took while it stalled, and lets go of them; and when Redis has lost the queue's consumer group
(restarted empty, flushed), creates it again and adopts the jobs it holds."""

from __future__ import annotations

import logging
import os
import socket
import time

from producer_client.keys import PROTOCOL_VERSION
from producer_client.protocol.events import encode_start
from producer_client.protocol.replies import Adopted
from worker.loop.context import LoopContext
from worker.loop.outbox import HeldStateError
from worker.loop.placement import adapters_advertised, advertised
from worker.loop.rejection import Rejections

log = logging.getLogger(__name__)


class Ownership:
    def __init__(self, ctx: LoopContext, rejections: Rejections, device: str, metrics_port: int | None):
        self.queue, self.job_commands, self.engine, self.holdings = (
            ctx.queue,
            ctx.job_commands,
            ctx.engine,
            ctx.holdings,
        )
        self.metrics, self.settings, self.clock, self.worker = ctx.metrics, ctx.settings, ctx.clock, ctx.worker
        self.rejections = rejections
        self.total_pages = ctx.engine.capacity().free_pages  # the engine is empty now
        self.next_heartbeat = 0.0
        # The consumer group must be created before the next read: at start, and whenever Redis
        # has lost it (then the jobs held here are adopted too).
        self.group_missing = True
        self.identity: dict[str, str | int | float] = {
            "name": ctx.worker,
            "queue": ctx.settings.queue,
            "model": ctx.settings.model,
            "device": device,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "protocol": PROTOCOL_VERSION,
            "started_at": time.time(),
            "metrics_port": metrics_port or 0,
        }

    def ms_to_heartbeat(self) -> int:
        return int((self.next_heartbeat - time.monotonic()) * 1000)

    def heartbeat_if_due(self, state: str) -> None:
        """Refresh the heartbeat and every held entry; let go of the entries another worker took."""
        now = time.monotonic()
        if now < self.next_heartbeat:
            return
        cap = self.engine.capacity()
        running = self.holdings.running
        started = sum(1 for j in running.values() if j.first_token_at is not None)
        fields: dict[str, str | int | float] = {
            **self.identity,
            "state": state,
            "running": len(running) + len(self.holdings.suspects),
            "free_slots": cap.free_slots,
            "free_pages": cap.free_pages,
            "total_pages": self.total_pages,
            "page_size": cap.page_size,
            **advertised(self.settings, self.holdings, self.worker),
            **adapters_advertised(self.engine),
        }
        held = self.holdings.entries()
        depth, lost = self.queue.members.heartbeat(fields, self.settings.heartbeat_ttl_s, list(held))
        self.next_heartbeat = now + self.settings.heartbeat_interval_s
        for entry_id in lost:
            log.warning(
                "job %s: its entry %s was reclaimed by another worker; this run stops", held[entry_id], entry_id
            )
            self.holdings.drop(held[entry_id])
        m = self.metrics
        m.queue_depth.set(depth)
        m.requests_running.set(started)
        m.requests_waiting.set(len(running) - started)
        m.kv_cache_usage.set(1 - cap.free_pages / self.total_pages if self.total_pages else 0.0)
        m.engine_totals(self.engine.stats())
        m.tokens_served(self.holdings.ledger.take_served())

    def group_lost(self, error: Exception) -> None:
        log.warning("Redis has lost the consumer group of queue %r (%s): creating it again", self.settings.queue, error)
        self.group_missing = True

    def restore_group(self) -> None:
        """Create the consumer group; if Redis lost it while this worker held jobs, their entries
        went with it: adopt each job (ADOPT) and run it on, detached from any entry. Nothing else
        can take such a job over, and its result reaches its producer as any other."""
        self.queue.groups.ensure()
        self.holdings.entries_lost()
        runs = self.holdings.runs()
        if runs:
            outcomes = self.job_commands.adopt(list(runs.items()))
            for (job_id, run), outcome in zip(runs.items(), outcomes):
                if isinstance(outcome, Exception):  # its keys refused ADOPT: it fails, detached
                    self.holdings.detach(job_id)
                    self.rejections.of_held(job_id, outcome)
                elif outcome in (Adopted.ADOPTED, Adopted.RECREATED):
                    self.holdings.detach(job_id)
                    if outcome is Adopted.RECREATED:
                        self._republish_whole(job_id, run)
                else:
                    log.warning("job %s: not adopted after the group was lost (%s); this run stops", job_id, outcome)
                    self.holdings.drop(job_id)
            log.warning("%d jobs held here run on, detached from their lost entries", len(runs))
        self.group_missing = False
        self.next_heartbeat = 0.0  # the heartbeat and the worker index may be gone as well

    def _republish_whole(self, job_id: str, run: str) -> None:
        """Redis lost the job's events with its hash: the next publication carries a start event
        and the whole output so far (with the final result, if it has one), so that the event
        stream is complete again for any reader, or any run that resumes the job from it."""
        job = self.holdings.find(job_id)
        if job is not None:
            started_at: float | None = job.started_at
            fmt = job.output_format
        else:  # it ended while Redis had it still: its result holds the whole output
            # A chat's result holds its answer split from its reasoning and calls already: its
            # stream carries the answer as plain text, and the result the rest.
            update = self.holdings.waiting_update(job_id)
            if update is None:
                raise HeldStateError(f"job {job_id}: its events are lost, and it is held neither running nor ended")
            started_at, fmt = update.ended().timings.started_at, None
        self.holdings.republish_whole(job_id, run, encode_start(self.worker, started_at, 0, fmt))
