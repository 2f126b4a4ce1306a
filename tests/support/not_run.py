"""A pytest plugin that reports the selected tests without running them: each is collected and marked
(the device tests' `device` property, tests/support/devices.py), its skip marks are evaluated as in
a real run, and its JUnit record is written, but neither its fixtures nor its body run.

tests/acceptance/test_rehearsal.py loads it (PYTEST_ADDOPTS) into the pytest steps of each GPU
stage's rehearsal: what that test proves of a step is its plumbing, that its selection collects,
its device tests are counted, its JSON and its table come out. The tests a step selects are
tests/' own, which the same CI run runs for real; running them again in the rehearsal cost two
minutes of CPU (the 11 stages' rehearsals: 428 s -> 301 s) and proved nothing more.
`scripts/gpu_acceptance.sh --rehearse` run by hand runs them for real, as a GPU session does."""

from __future__ import annotations

import pytest

SUMMARY = "tests/support/not_run.py: {} tests reported, not run"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function):
            # The item's own steps, not the hooks around them: the skipping plugin's setup hook still
            # evaluates skip marks (a device test without its GPU still skips, for its reason).
            item.setup = item.runtest = lambda: None


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    reported = sum(len(terminalreporter.stats.get(key, [])) for key in ("passed", "skipped"))
    terminalreporter.write_line(SUMMARY.format(reported))
