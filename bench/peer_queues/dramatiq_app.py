"""Dramatiq: its Redis broker and the Results middleware with the Redis backend (results kept for
the middleware's default result_ttl, 10 minutes). Worker: `dramatiq bench.peer_queues.dramatiq_app`."""

from __future__ import annotations

from collections.abc import Callable

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from bench.peer_queues.job import RESULT_TIMEOUT_S, echo, redis_url

broker = RedisBroker(url=redis_url())
broker.add_middleware(Results(backend=RedisBackend(url=redis_url())))
dramatiq.set_broker(broker)


@dramatiq.actor(store_results=True)
def echo_job(prompt: str) -> str:
    return echo(prompt)


def direct() -> Callable[[str], str]:
    return echo


class Producer:
    def submit(self, prompt: str):
        return echo_job.send(prompt)

    def result(self, message) -> str:
        return message.get_result(block=True, timeout=RESULT_TIMEOUT_S * 1000)

    def close(self) -> None:
        pass
