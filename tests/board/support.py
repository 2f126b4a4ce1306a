"""The queues and settings of the board's gateways (conftest.py starts them) that tests name too,
and a pause of the board's worker."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.workers import WorkerProcess

ECHO_QUEUE = "board-echo"
PARKED_QUEUE = "board-parked"  # routed by the gateway, served by no worker: its jobs wait
API_KEY = "board-test-key"
KEEPALIVE_S = 0.2
# The brisk gateway's: shorter than it takes any machine to read again the events of a job of
# LONG_PROMPT followed as it runs (up to 16,000: one a step), as a feed that opened a stream() per
# keep-alive had to before each new event.
BRISK_KEEPALIVE_S = 0.005


@contextmanager
def worker_paused(worker: WorkerProcess) -> Iterator[None]:
    """The worker's process stopped (SIGSTOP) inside, going on after (SIGCONT)."""
    worker.process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        worker.process.send_signal(signal.SIGCONT)
