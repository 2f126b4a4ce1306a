"""Celery: Redis as broker and as result backend (results kept for the default result_expires, one
day). Worker: `celery -A bench.peer_queues.celery_app worker`."""

from __future__ import annotations

from collections.abc import Callable

from celery import Celery

from bench.peer_queues.job import RESULT_TIMEOUT_S, echo, redis_url

app = Celery("peers", broker=redis_url(), backend=redis_url())
app.conf.broker_connection_retry_on_startup = True  # silences 5.x's deprecation warning; the server is up


@app.task
def echo_job(prompt: str) -> str:
    return echo(prompt)


def direct() -> Callable[[str], str]:
    return echo


class Producer:
    def submit(self, prompt: str):
        return echo_job.delay(prompt)

    def result(self, async_result) -> str:
        return async_result.get(timeout=RESULT_TIMEOUT_S)

    def close(self) -> None:
        pass
