"""What every part of the queue loop shares, made once by the Worker (service.py) and handed to
each part whole, so that no constructor takes the same seven things one by one."""

from __future__ import annotations

from dataclasses import dataclass

from worker.engine.interface import EngineAPI
from worker.loop.holdings import Holdings
from worker.loop.job_commands import JobCommands
from worker.loop.queue import RedisClock
from worker.loop.worker_queue import WorkerQueue
from worker.metrics import WorkerMetrics
from worker.settings import WorkerSettings


@dataclass(frozen=True)
class LoopContext:
    worker: str  # this worker's name: its consumer name, in logs and results
    settings: WorkerSettings
    engine: EngineAPI
    queue: WorkerQueue  # the Redis commands on the queue's keys
    job_commands: JobCommands  # the Redis commands on each job's keys
    clock: RedisClock  # every time the loop writes or compares is on Redis's clock
    metrics: WorkerMetrics
    holdings: Holdings  # the jobs this worker holds and what Redis has not seen: changed only through its verbs
