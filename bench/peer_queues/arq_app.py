"""arq: its Redis queue (a sorted set the worker polls every poll_delay, default 0.5 s) and its
results (kept for keep_result, default 3,600 s). The producer's `job.result` polls too (poll_delay,
default 0.5 s); both are PEERS_POLL_S here. Worker: `arq bench.peer_queues.arq_app.WorkerSettings`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ClassVar

from arq import create_pool
from arq.connections import RedisSettings

from bench.peer_queues.job import RESULT_TIMEOUT_S, echo, poll_s, redis_url


async def echo_job(ctx: dict, prompt: str) -> str:
    return echo(prompt)


async def quiet(ctx: dict) -> None:
    """arq's CLI logs every job at INFO; the other workers run at WARNING, and so does this one."""
    logging.getLogger("arq").setLevel(logging.WARNING)


class WorkerSettings:
    functions: ClassVar = [echo_job]
    redis_settings = RedisSettings.from_dsn(redis_url())
    poll_delay = poll_s()
    on_startup = quiet


def direct() -> Callable[[str], str]:
    return echo


class Producer:
    async def start(self) -> None:
        self.redis = await create_pool(RedisSettings.from_dsn(redis_url()))

    async def submit(self, prompt: str):
        return await self.redis.enqueue_job("echo_job", prompt)

    async def result(self, job) -> str:
        return await job.result(timeout=RESULT_TIMEOUT_S, poll_delay=poll_s())

    async def close(self) -> None:
        await self.redis.aclose()
