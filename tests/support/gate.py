"""A pytest plugin for scripts/test.sh's lanes: a lane's process starts early and collects then
(about 6 s of CPU for the whole tree), but runs its first test only once the file named by
MILI_TESTS_GATE exists, which test.sh creates when what the lane waits for is done
(MILI_TESTS_GATE_FOR names it): the kernels' warm-up for the xdist and waits lanes, whose
collections run beside it; the other lanes for the timing lane, which collects beside them and
then runs alone, as before."""

from __future__ import annotations

import os
import time

import pytest

POLL_S = 0.2
WAITED = "tests/support/gate.py: waited {:.0f} s for {} before the first test"
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
        terminalreporter.write_line(WAITED.format(config.stash[WAITED_KEY], os.environ["MILI_TESTS_GATE_FOR"]))
