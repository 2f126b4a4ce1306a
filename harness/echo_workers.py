"""The queue loop in this process, driving the echo engine, for tests against a real redis-server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from worker.engine.echo import EchoEngine
from worker.engine.outputs import RequestOutput
from worker.loop.queue import RedisClock, connect
from worker.loop.service import Worker
from worker.metrics import WorkerMetrics
from worker.settings import WorkerSettings


class SlowEchoEngine(EchoEngine):
    """Echo with a fixed step time, so that jobs are running long enough to be acted on."""

    def __init__(self, settings, step_s: float = 0.005, fail_on_step: int | None = None):
        super().__init__(settings)
        self.step_s = step_s
        self.fail_on_step = fail_on_step

    def step(self):
        time.sleep(self.step_s)
        if self._steps + 1 == self.fail_on_step:
            self._steps += 1
            raise RuntimeError("injected step failure")
        return super().step()


class HoldingEchoEngine(SlowEchoEngine):
    """Echo that emits the first HOLD_AT tokens of each job, then holds it (its steps go on and
    emit nothing for it) until `release()`: a job still running when the test acts on it, however
    long a loaded machine takes, rather than one paced to outlast the test's steps."""

    HOLD_AT = 100

    def __init__(self, settings, step_s: float = 0.005, fail_on_step: int | None = None):
        super().__init__(settings, step_s, fail_on_step)
        self.released = False

    def release(self) -> None:
        """The held jobs go on to their ends."""
        self.released = True

    def _emit_next(self, req):
        if self.released or req.emitted < self.HOLD_AT:
            return super()._emit_next(req)
        return RequestOutput(req.request_id, [], "", False, None, req.usage())


class ThreadedWorker(Worker):
    def start(self) -> ThreadedWorker:
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()
        return self

    def wait_stopped(self, timeout: float = 10) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive()


class WorkerKilled(Exception):
    """Ends a killed GatedWorker's thread, long after it stopped talking."""


class GatedWorker(ThreadedWorker):
    """A worker whose every exchange with Redis and every engine step passes a gate (the Worker's
    pause point): closed for a while, the worker stalls (no heartbeat, no refresh); closed for good
    (`killed`), it is dead, as after kill -9, between two exchanges, with nothing handed over or
    cleaned up. `held()` stops it at its next gate for as long as a test acts on it."""

    def __init__(self, *args, **kwargs):
        self.gate = threading.Event()
        self.gate.set()
        self.stopped = threading.Event()  # the loop waits at a closed gate
        self.killed = False
        super().__init__(*args, pause_point=self.pass_gate, **kwargs)

    def pass_gate(self) -> None:
        if not self.gate.is_set():
            self.stopped.set()
        self.gate.wait()
        if self.killed:
            raise WorkerKilled(self.name)

    @contextmanager
    def held(self, timeout: float = 10) -> Iterator[None]:
        """The loop stopped at its next gate (an engine step or an exchange with Redis) until the
        block ends: what the test reads of its jobs meanwhile is what they are while it acts (its
        publisher may still answer the round it sent)."""
        self.stopped.clear()
        self.gate.clear()
        try:
            assert self.stopped.wait(timeout), "the loop did not reach its gate"
            yield
        finally:
            self.gate.set()

    def serve(self) -> None:
        try:
            super().serve()
        except WorkerKilled:
            pass


@contextmanager
def serving(
    url: str,
    queue: str,
    step_s: float = 0.0,
    fail_on_step: int | None = None,
    engine_class=SlowEchoEngine,
    name: str | None = None,
    clock: RedisClock | None = None,
    worker_class=ThreadedWorker,
    timer=time.perf_counter,
    **overrides,
):
    engine_overrides = overrides.pop("engine", {})
    settings = WorkerSettings.load(
        None,
        **{
            "redis": url,
            "queue": queue,
            "name": name or f"w-{queue}",
            "block_ms": 20,
            "heartbeat_interval_s": 0.05,
            "redis_backoff_max_s": 0.2,
            "metrics_port": 0,
            "engine": engine_overrides,
            **overrides,
        },
    )
    engine = engine_class(settings.engine, step_s, fail_on_step)
    client = connect(url)
    worker = worker_class(engine, client, settings, WorkerMetrics(), settings.name, clock=clock, timer=timer).start()
    try:
        yield worker
    finally:
        worker.request_stop()
        worker.request_stop()
        worker.wait_stopped()
        client.close()


def outcome_count(worker: Worker, outcome: str) -> float:
    return worker.metrics.registry.get_sample_value("mili_jobs_total", {"outcome": outcome})
