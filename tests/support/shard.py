"""A pytest plugin for scripts/test.sh's quick timing lane: processes given the same empty folder in
MILI_TESTS_SHARE, and the same tests, share the tests out as they go, each test run by one of them.

The timing tests run after every other lane, each mostly asleep (3.5 s of CPU over ~29 s of wall
on a quiet machine): two processes, a core each, end them in about half the time. pytest-xdist
would do it with a controller and two workers, three processes importing torch and collecting
beside the CPU-bound lanes (y/suite6: more CPU there than the shorter tail saved); two plain
processes cost one collection more and no controller.

The unit taken is a test, or all the tests of an xdist_group (tests/support/tiers.py groups those
that share a fixture's processes or a module's fixtures), which stay together so their setup runs
once. Before a unit a process takes the next one nobody has: the first to make the folder's entry
of its index (os.mkdir, which one process alone can do) runs it. So a process held by a long test
takes fewer of the others, where dealing them out in turn ended one share long before the other
(the longest timing tests sit next to each other in their modules). A process takes its next unit
before the last test of the one it runs, so that test's teardown knows what comes next and keeps
the fixtures both need (the session's redis-server). What the other process ran is reported
deselected here."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterator

import pytest

SHARE_ENV = "MILI_TESTS_SHARE"


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
    run_shared(session, folder)
    return True
