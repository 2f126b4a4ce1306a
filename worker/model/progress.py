"""Long start-up steps as log lines a user can follow: writing a preset's checkpoint on its first
use, loading a model, compiling kernels. A step logs a line when it begins, one every
`every_s` while it runs (a first start compiles for tens of seconds on a small machine: a log
that says nothing for that long reads as a hang), and one with its time when it ends. A step that
fails logs no end: its error says what happened."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

PROGRESS_EVERY_S = 4.0


@contextmanager
def logged_step(log: logging.Logger, what: str, every_s: float = PROGRESS_EVERY_S) -> Iterator[None]:
    log.info("%s ...", what)
    started = time.perf_counter()
    ended = threading.Event()

    def remind() -> None:
        while not ended.wait(every_s):
            log.info("%s: %.0f s so far", what, time.perf_counter() - started)

    reminder = threading.Thread(target=remind, name="mili-progress", daemon=True)
    reminder.start()
    try:
        yield
    finally:
        ended.set()
        reminder.join()
    log.info("%s: done in %.1f s", what, time.perf_counter() - started)
