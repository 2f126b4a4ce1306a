"""A pytest plugin for scripts/test.sh's timing lane: its process starts beside the others and
collects then (the whole tree, about 6 s of CPU, which was the lane's own time after theirs), but
runs its first test only once the file named by MILI_TESTS_GATE exists, which test.sh creates when
the others are done: nothing runs beside the timing tests, as before."""

from __future__ import annotations

import os
import time

import pytest

POLL_S = 0.2
WAITED = "tests/support/gate.py: waited {:.0f} s for the other lanes before the first test"
WAITED_KEY = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    gate = os.environ["MILI_TESTS_GATE"]
    started = time.monotonic()
    while not os.path.exists(gate):
        time.sleep(POLL_S)
    session.config.stash[WAITED_KEY] = time.monotonic() - started


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    # pytest's "in N s" counts from the start, the wait included: this says how much of it was the wait.
    if WAITED_KEY in config.stash:
        terminalreporter.write_line(WAITED.format(config.stash[WAITED_KEY]))
