"""MILI: the producer client against echo workers (`python -m worker serve --model echo`). The load
submits and waits by `generate` (`run`), the client's documented call for both (README): where
nothing can refuse the enqueue (a job placed on a worker's stream, as most are here) its create,
enqueue and blocking read of the job's `done` stream are one round trip. `submit` alone is what the
submit figures time, and `submit` then `wait` (the documented read of a job this client has just
submitted: one blocking read of its `done` stream) what the warm-up runs. Results are kept for the
workers' result_ttl_s (default 3,600 s)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

from bench.peer_queues.job import MAX_TOKENS_VARIABLE, RESULT_TIMEOUT_S, redis_url
from producer_client import Client, SamplingParams

QUEUE = "bench"


def max_tokens() -> int:
    return int(os.environ.get(MAX_TOKENS_VARIABLE, "1"))


def direct() -> Callable[[str], str]:
    """The job without the queue: the echo engine called in-process, as a worker calls it."""
    from worker.engine.echo import EchoEngine
    from worker.engine.settings import EngineSettings

    engine = EchoEngine(EngineSettings())
    params = SamplingParams(max_tokens=max_tokens(), temperature=0.0)

    ids = itertools.count()

    def run(prompt: str) -> str:
        engine.add_request(str(next(ids)), engine.tokenizer.encode(prompt), params)
        text = ""
        while True:
            for out in engine.step():
                text += out.text_delta
                if out.finished:
                    return text

    return run


class Producer:
    def __init__(self):
        self.client = Client(redis_url(), QUEUE)

    def submit(self, prompt: str) -> str:
        return self.client.submit(prompt, max_tokens=max_tokens(), temperature=0.0)

    def result(self, job_id: str) -> str:
        return self.client.wait(job_id, timeout=RESULT_TIMEOUT_S).text

    def run(self, prompt: str) -> str:
        return self.client.generate(prompt, max_tokens=max_tokens(), temperature=0.0, timeout=RESULT_TIMEOUT_S).text

    def close(self) -> None:
        self.client.close()
