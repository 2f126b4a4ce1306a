"""A long start-up step logs when it begins, a line every interval while it runs, and its time
when it ends; a step that fails logs no end, and says nothing more once it has failed."""

from __future__ import annotations

import logging
import re
import time

import pytest

from worker.model.progress import logged_step

EVERY_S = 0.1
log = logging.getLogger("tests.progress")


def messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == log.name]


@pytest.mark.timing
def test_a_step_says_it_began_how_long_it_has_run_every_interval_and_when_it_ended(caplog):
    caplog.set_level(logging.INFO, log.name)
    with logged_step(log, "compiling", every_s=EVERY_S):
        time.sleep(6 * EVERY_S)
    first, *reminders, last = messages(caplog)
    assert first == "compiling ..."
    assert 3 <= len(reminders) <= 6, reminders
    assert all(re.fullmatch(r"compiling: \d+ s so far", line) for line in reminders)
    elapsed = float(re.fullmatch(r"compiling: done in (\d+\.\d) s", last).group(1))
    assert 0.5 <= elapsed < 2.0


@pytest.mark.timing
def test_a_step_that_fails_logs_no_end_and_stops_reminding(caplog):
    caplog.set_level(logging.INFO, log.name)
    with pytest.raises(ValueError, match="no such checkpoint"), logged_step(log, "loading", every_s=EVERY_S):
        time.sleep(2.5 * EVERY_S)
        raise ValueError("no such checkpoint")
    failed = messages(caplog)
    time.sleep(3 * EVERY_S)
    assert messages(caplog) == failed
    assert failed[0] == "loading ..." and not any("done" in line for line in failed)
