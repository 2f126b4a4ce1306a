"""The suite's tiers, given to each test by rule, not by hand (scripts/test.sh --quick runs the tests
of none of them):

- `chaos`: the tests of tests/chaos, which do faults for real to live processes;
- `e2e`: the tests of tests/e2e and tests/board, and any test elsewhere that starts a worker, a
  gateway, a browser or a multi-node Redis, itself or through a fixture: its function, or one of
  its fixtures' functions, names one of STARTERS;
- `slow`: set by hand on a test that takes more than 10 s on its own on a quiet machine.

A test that asserts a bound on elapsed time carries `timing`: scripts/test.sh runs those after the
others, so that no other test running beside them on another core stretches their time (alone in the
full run; four at a time with --quick, each mostly asleep: tests/support/shard.py).

A module whose tests mostly wait (on claim_idle_ms, timeouts, Redis restarts and failovers, other
processes' retries) carries `waits`, set by hand: run alone on a quiet machine, it uses less than
half a core on average (the busy time /proc/stat counts over its run, over its wall time).
scripts/test.sh runs those in a third pytest process beside the two xdist processes of the
others (three, forked from one, with --quick, where one ended last): their waits then overlap the others' work
instead of adding to the run's time.

Both `timing` and `waits` are written in the test's own module (`pytest.mark.timing`,
`pytest.mark.waits`, on the test or as its module's `pytestmark`): scripts/test.sh gives their
lanes only the modules whose text names their mark, so a test marked from elsewhere (a conftest, a
helper) would run in no lane; the collection refuses it.

Under pytest-xdist (scripts/test.sh runs `-n 2 --dist loadgroup`) the tests that share processes
started by a fixture of module scope or wider run on one xdist worker (their `xdist_group`), so
those processes start once: a worker on the tiny model costs seconds of CPU to start. So do the
tests that share a module-scoped fixture of their module."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
CHAOS_DIRS = frozenset({"chaos"})
E2E_DIRS = frozenset({"e2e", "board"})
# What starts a process beside the session's redis-server: the harness's classes and helpers,
# and the other fixtures that a test may depend on for one.
STARTERS = frozenset(
    {
        "ChildProcess",
        "WorkerProcess",
        "GatewayProcess",
        "start_workers",
        "echo_workers",
        "echo_worker",
        "kill_until_dead_lettered",
        "LocalCluster",
        "LocalSentinel",
        "sync_playwright",
        "redis_cluster",
        "redis_sentinel",
        "redis_deployment",
    }
)


def names_in(code: types.CodeType) -> set[str]:
    """The global names and arguments a function's code uses, its nested functions' included."""
    names = set(code.co_names) | set(code.co_varnames[: code.co_argcount + code.co_kwonlyargcount])
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= names_in(const)
    return names


WIDEST_FIRST = ("session", "package", "module")


def starts_processes(function) -> bool:
    return hasattr(function, "__code__") and not STARTERS.isdisjoint(names_in(function.__code__))


def fixture_definitions(item: pytest.Function) -> list:
    return [definitions[-1] for definitions in item._fixtureinfo.name2fixturedefs.values() if definitions]


def shared_process_group(item: pytest.Function) -> str | None:
    """The module that defines the widest fixture (of module scope or wider) that starts processes
    for this test, None if there is none: a package's conftest.py for the processes its tests
    share, the test's own module for those of one module. A Cluster or a Sentinel setup starts in
    seconds, and is not worth keeping its tests on one xdist worker."""
    cheap = {"redis_cluster", "redis_sentinel", "redis_deployment"}
    shared = [
        d
        for d in fixture_definitions(item)
        if d.scope in WIDEST_FIRST and d.argname not in cheap and starts_processes(d.func)
    ]
    if not shared:
        return None
    return min(shared, key=lambda d: WIDEST_FIRST.index(d.scope)).func.__module__


def shared_setup_group(item: pytest.Function) -> str | None:
    """The test's module, for a test that uses a fixture of module scope defined there: the fixture
    runs once only if the module's tests all run on one xdist worker. Spread over two, each builds it
    (the 32K engine run takes two minutes; test_tokenizer's three tokenizers and
    test_grammar_vocabulary's tables seconds of CPU each), and a parametrized one again after each
    test of another parameter between a parameter's tests (test_tensor_parallel.py's two-rank
    engines: 8 setups of 4 parameters)."""
    module = item.module.__name__
    own = [d for d in fixture_definitions(item) if d.scope == "module" and d.func.__module__ == module]
    return module if own else None


def tier_of(item: pytest.Function) -> str | None:
    package = Path(item.path).relative_to(TESTS).parts[0]
    if package in CHAOS_DIRS:
        return "chaos"
    functions = [item.function] + [d.func for d in fixture_definitions(item)]
    if package in E2E_DIRS or any(starts_processes(f) for f in functions):
        return "e2e"
    return None


# The marks scripts/test.sh runs in lanes of their own, which it finds by their modules' text.
LANE_MARKS = ("timing", "waits")


def marked_outside_their_module(items: list[pytest.Item]) -> list[str]:
    """The tests that carry a lane's mark their module's text does not name: what test.sh's lanes,
    given the modules that name it, would not collect (and the others deselect)."""
    texts: dict[Path, str] = {}
    outside = []
    for item in items:
        for mark in LANE_MARKS:
            if item.get_closest_marker(mark) is None:
                continue
            path = Path(item.path)
            if path not in texts:
                texts[path] = path.read_text()
            if f"pytest.mark.{mark}" not in texts[path]:
                outside.append(f"{item.nodeid} ({mark})")
    return outside


# First: pytest-xdist's own hook reads each test's xdist_group to name its group, and runs before a
# plain hook of a plugin loaded from a conftest; a group marked after it is no group at all.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    outside = marked_outside_their_module(items)
    if outside:
        raise pytest.UsageError(
            "tests marked for a lane of their own where their module does not name the mark "
            f"(scripts/test.sh would run them in no lane): {', '.join(outside)}"
        )
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        tier = tier_of(item)
        if tier is not None:
            item.add_marker(tier)
        # A group set by hand is kept: its module puts tests together that share more than a
        # fixture (test_schedules' totals check reads what the schedules added up in its process).
        group = shared_process_group(item) or shared_setup_group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
