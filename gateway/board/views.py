"""What the board shows, read from Redis alone through the client library: one `Overview` of every
queue (its numbers, its running, waiting and dead jobs) and every worker, and one `JobView` per
job page. Queues are those of the queue index (served by a worker in the last hour) and those the
gateway routes to (its default queue and its `models` map), read concurrently."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from gateway.board.throughput import Throughput, ThroughputMeter
from producer_client import AsyncClient, JobStatus
from producer_client.dead_letters import DeadLetter
from producer_client.inspection import JobEntry, QueueOverview, RunningJob, WaitingJob, WorkerHealth

JOBS_SHOWN = 20  # running, waiting and dead jobs listed per queue


@dataclass(frozen=True)
class QueueRow:
    overview: QueueOverview
    throughput: Throughput | None


@dataclass(frozen=True)
class Overview:
    queues: list[QueueRow]
    workers: list[WorkerHealth]
    running: list[RunningJob]
    waiting: list[WaitingJob]
    dead: list[DeadLetter]


@dataclass(frozen=True)
class QueueContents:
    overview: QueueOverview
    running: list[RunningJob]
    waiting: list[WaitingJob]
    dead: list[DeadLetter]


@dataclass(frozen=True)
class JobView:
    status: JobStatus
    entry: JobEntry | None  # where its body is, while it is kept


class BoardReader:
    def __init__(self, client: AsyncClient, routed_queues: set[str]):
        self.client = client
        self.routed_queues = routed_queues
        self.meter = ThroughputMeter()

    async def queues(self) -> list[str]:
        return sorted(set(await self.client.inspect.queues()) | self.routed_queues)

    async def overview(self) -> Overview:
        queues = await self.queues()
        contents, workers = await asyncio.gather(
            asyncio.gather(*(self.contents(queue) for queue in queues)),
            self.client.inspect.workers(),
        )
        self.meter.forget_others(set(queues))
        rows = [
            QueueRow(c.overview, self.meter.observe(c.overview.queue, c.overview.at, c.overview.processed))
            for c in contents
        ]
        return Overview(
            queues=rows,
            workers=workers,
            running=[j for c in contents for j in c.running],
            waiting=[j for c in contents for j in c.waiting],
            dead=[d for c in contents for d in c.dead],
        )

    async def contents(self, queue: str) -> QueueContents:
        client = self.client.on_queue(queue)
        overview, running, waiting, dead = await asyncio.gather(
            client.inspect.overview(),
            client.inspect.running(JOBS_SHOWN),
            client.inspect.waiting(JOBS_SHOWN),
            client.dead_letters.list(JOBS_SHOWN),
        )
        return QueueContents(overview, running, waiting, dead)

    async def job(self, job_id: str) -> JobView:
        status = await self.client.status(job_id)
        return JobView(status, await self.client.inspect.entry_of(status, await self.queues()))
