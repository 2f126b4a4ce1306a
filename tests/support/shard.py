"""A pytest plugin for scripts/test.sh's quick waits and timing lanes: processes given the same
empty folder in MILI_TESTS_SHARE, and the same tests, share the tests out as they go, each test
run by one of them; given MILI_TESTS_SHARES=N as well, one process collects and forks the N - 1
others at its first test (after tests/support/gate.py's wait).

Both lanes' tests are mostly asleep (the timing tests ~5 s of CPU over ~37 s of wall on a quiet
machine, one after the other): N processes end them in about 1/N of the time. pytest-xdist would
do it with a controller and N workers, each importing torch and collecting (~4-5 s of CPU, the
controller ~3 s and ~3-6 s more as the run goes), and so would N plain processes, in the phase
where the xdist lane keeps both cores busy; forked, they share one collection.

The unit taken is a test, or all the tests of an xdist_group (tests/support/tiers.py groups those
that share a fixture's processes or a module's fixtures), which stay together so their setup runs
once. Before a unit a process takes the next one nobody has: the first to make the folder's entry
of its index (os.mkdir, which one process alone can do) runs it. So a process held by a long test
takes fewer of the others, where dealing them out in turn ended one share long before the other
(the longest timing tests sit next to each other in their modules). A process takes its next unit
before the last test of the one it runs, so that test's teardown knows what comes next and keeps
the fixtures both need (the session's redis-server). What the others ran is reported deselected
in each. A forked process writes its report to a file of the folder; the first waits for them
after its own share, adds their reports after its own, and fails where one of them did."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

SHARE_ENV = "MILI_TESTS_SHARE"
SHARES_ENV = "MILI_TESTS_SHARES"
FORKED_REPORTS = pytest.StashKey[list[tuple[str, str]]]()


def unit_of(item: pytest.Item) -> str:
    group = item.get_closest_marker("xdist_group")
    if group is not None:
        return "group " + str(group.kwargs.get("name", group.args[0] if group.args else ""))
    return item.nodeid


def units(items: list[pytest.Item]) -> list[list[pytest.Item]]:
    """The tests by unit, in the order each unit first appears."""
    by_unit: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_unit.setdefault(unit_of(item), []).append(item)
    return list(by_unit.values())


def taken(folder: str, index: int) -> bool:
    """Whether this process is the first to take unit `index` (and so takes it)."""
    try:
        os.mkdir(os.path.join(folder, str(index)))
    except FileExistsError:
        return False
    return True


def units_taken(folder: str, all_units: list[list[pytest.Item]]) -> Iterator[list[pytest.Item]]:
    """The units this process takes, each taken when asked for."""
    return (unit for index, unit in enumerate(all_units) if taken(folder, index))


def run_shared(session: pytest.Session, folder: str) -> None:
    mine = units_taken(folder, units(session.items))
    queue = deque(next(mine, []))
    ran = set()
    while queue:
        item = queue.popleft()
        if not queue:  # the unit's last test: take the next unit first, for this test's teardown
            queue.extend(next(mine, []))
        item.config.hook.pytest_runtest_protocol(item=item, nextitem=queue[0] if queue else None)
        ran.add(item.nodeid)
        if session.shouldfail:
            raise session.Failed(session.shouldfail)
        if session.shouldstop:
            raise session.Interrupted(session.shouldstop)
    others = [item for item in session.items if item.nodeid not in ran]
    if others:
        session.config.hook.pytest_deselected(items=others)


# pytest's own loop, when every test of the session runs here; after tests/support/gate.py's wait
# (tryfirst there), before pytest's loop (a plugin's hook runs before the built-in one's).
def pytest_runtestloop(session: pytest.Session) -> bool | None:
    folder = os.environ.get(SHARE_ENV)
    if not folder or session.config.option.collectonly:
        return None
    if session.testsfailed and not session.config.option.continue_on_collection_errors:
        raise session.Interrupted(
            f"{session.testsfailed} error{'s' if session.testsfailed != 1 else ''} during collection"
        )
    forked = fork_shares(session.config, folder, int(os.environ.get(SHARES_ENV, "1")))
    try:
        run_shared(session, folder)
    finally:
        add_forked_reports(session, forked)
    return True


def fork_shares(config: pytest.Config, folder: str, shares: int) -> dict[int, Path]:
    """The forked processes' ids and report files; empty in a forked one."""
    forked: dict[int, Path] = {}
    for share in range(1, shares):
        report = Path(folder, f"report-{share}")
        sys.stdout.flush()  # or what the report holds unwritten would be written by each process
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            report_to(config, report)
            return {}
        forked[pid] = report
    # test.sh's clean-up stops this process only: the forked ones stop with it.
    signal.signal(signal.SIGTERM, lambda signum, frame: stop_forked(forked))
    return forked


def report_to(config: pytest.Config, report: Path) -> None:
    """This process's output (pytest's report and what its tests leave uncaptured) into `report`.
    pytest's capture keeps a copy of the descriptors it replaces and puts it back after each test:
    so it stops, the descriptors change, and it starts again over them."""
    capture = config.pluginmanager.getplugin("capturemanager")  # None under -p no:capture
    if capture is not None:
        capture.stop_global_capturing()
    written = os.open(report, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(written, sys.stdout.fileno())
    os.dup2(written, sys.stderr.fileno())
    os.close(written)
    if capture is not None:
        capture.start_global_capturing()
        capture.suspend_global_capture()


def stop_forked(forked: dict[int, Path]) -> None:
    for pid in forked:
        with contextlib.suppress(ProcessLookupError):  # one that has ended and been waited for
            os.kill(pid, signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def add_forked_reports(session: pytest.Session, forked: dict[int, Path]) -> None:
    """Waits for the forked processes; a failed one fails this session, and their reports follow
    this one's summary."""
    reports = []
    for share, (pid, report) in enumerate(forked.items(), start=1):
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        reports.append((f"share {share} of the tests, a forked process: exit status {status}", report.read_text()))
        if status not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.testsfailed += 1
    session.config.stash[FORKED_REPORTS] = reports


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    for title, text in config.stash.get(FORKED_REPORTS, []):
        terminalreporter.write_sep("-", title)
        terminalreporter.write(text)
