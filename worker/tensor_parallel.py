"""The worker's side of a tensor-parallel engine (worker/engine/ranks.py): the group is one
worker. Its ranks stop with the worker, after a drain or on any error; and a rank that fails ends
the worker within a bounded time.

The engine raises RankFailed at the loop's next call once a rank has exited, or from the
collective a hung rank never joins (after tensor_parallel_timeout_s): the loop unwinds, the
heartbeat is removed, and the jobs' entries, never acknowledged, are reclaimed by other workers
after claim_idle_ms, exactly as after a kill -9. Where the loop makes no engine call for that
long (Redis unreachable with the outbox full, a device wait that never returns), this module
ends the process itself once the timeout has passed again.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

log = logging.getLogger(__name__)

EXIT_RANK_FAILED = 3


@contextmanager
def rank_group(engine) -> Iterator[None]:
    """Holds the engine's ranks for the worker's lifetime (an engine of one rank, or the echo
    engine, has none)."""
    ranks = getattr(engine, "ranks", None)
    if ranks is None:
        yield
        return
    grace_s = engine.settings.tensor_parallel_timeout_s
    threading.Thread(target=exit_after_failure, args=(ranks.failed, grace_s), name="mili-tp-exit", daemon=True).start()
    try:
        yield
    finally:
        engine.close()


def exit_after_failure(failed: threading.Event, grace_s: float) -> None:
    failed.wait()
    time.sleep(grace_s)
    if threading.main_thread().is_alive():
        log.critical("a tensor-parallel rank failed %.0f s ago and the worker is still up: exiting now", grace_s)
        os._exit(EXIT_RANK_FAILED)
