"""taskiq: taskiq-redis's RedisStreamBroker (XREADGROUP, acknowledged) and RedisAsyncResultBackend
(results kept: its default result_ex_time is none). The producer waits with `wait_result`, which
polls every check_interval (default 0.2 s; PEERS_POLL_S here). Worker: `taskiq worker
bench.peer_queues.taskiq_app:broker`."""

from __future__ import annotations

from collections.abc import Callable

from taskiq_redis import RedisAsyncResultBackend, RedisStreamBroker

from bench.peer_queues.job import RESULT_TIMEOUT_S, echo, poll_s, redis_url

broker = RedisStreamBroker(url=redis_url()).with_result_backend(RedisAsyncResultBackend(redis_url=redis_url()))


@broker.task
async def echo_job(prompt: str) -> str:
    return echo(prompt)


def direct() -> Callable[[str], str]:
    return echo


class Producer:
    async def start(self) -> None:
        await broker.startup()

    async def submit(self, prompt: str):
        return await echo_job.kiq(prompt)

    async def result(self, task) -> str:
        outcome = await task.wait_result(check_interval=poll_s(), timeout=RESULT_TIMEOUT_S)
        return outcome.return_value

    async def close(self) -> None:
        await broker.shutdown()
