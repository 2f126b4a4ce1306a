"""scripts/test.sh gives the `waits` and `timing` lanes only the modules whose text names their mark
(collecting the whole tree cost each of their processes ~5 s more CPU), and deselects both marks
from the others: a test marked from outside its module would run in no lane, so the collection
refuses it (tests/support/tiers.py). With --quick no lane collects the folders whose every test is
of a tier it leaves out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support import shard
from tests.support.tiers import CHAOS_DIRS, E2E_DIRS, marked_outside_their_module

TEST_SH = Path(__file__).resolve().parents[2] / "scripts" / "test.sh"


def item(path: Path, *marks: str, name: str = "test", group: str | None = None) -> SimpleNamespace:
    found = {mark: getattr(pytest.mark, mark).mark for mark in marks}
    if group is not None:
        found["xdist_group"] = pytest.mark.xdist_group(group).mark
    return SimpleNamespace(path=path, nodeid=f"{path.name}::{name}", get_closest_marker=found.get)


def test_a_lane_mark_its_module_does_not_name_is_refused(tmp_path):
    named = tmp_path / "test_named.py"
    named.write_text("import pytest\n\npytestmark = pytest.mark.waits\n")
    unnamed = tmp_path / "test_unnamed.py"
    unnamed.write_text("def test():\n    pass\n")  # marked by a conftest's hook, say
    items = [item(named, "waits"), item(unnamed, "timing"), item(unnamed, "waits"), item(unnamed)]
    assert marked_outside_their_module(items) == ["test_unnamed.py::test (timing)", "test_unnamed.py::test (waits)"]


def quick_branch(script: str) -> str:
    """What test.sh sets only for --quick: the body of its `if` on the flag."""
    start = script.index('if [ "${1:-}" = "--quick" ]; then')
    return script[start : script.index("\nfi\n", start)]


def test_the_quick_run_collects_no_folder_whose_every_test_it_leaves_out():
    """tiers.py gives every test of tests/chaos `chaos` and of tests/e2e and tests/board `e2e` by their
    folder: --quick deselects them all, so its lanes leave those folders out, and only those."""
    script = TEST_SH.read_text()
    assert "\nleft_out=()\n" in script  # the full run collects every folder
    [line] = [line for line in quick_branch(script).splitlines() if line.strip().startswith("left_out=(")]
    assert set(line.strip()[len("left_out=(") : -1].split()) == CHAOS_DIRS | E2E_DIRS


def fake_session(items: list, run) -> SimpleNamespace:
    """What shard.run_shared reads of a pytest session; `run(item, nextitem)` stands for the test's run."""
    deselected: list = []
    hook = SimpleNamespace(
        pytest_runtest_protocol=lambda item, nextitem: run(item, nextitem),
        pytest_deselected=lambda items: deselected.extend(items),
    )
    config = SimpleNamespace(hook=hook)
    own = [SimpleNamespace(**vars(test), config=config) for test in items]  # each process collects its own
    return SimpleNamespace(items=own, config=config, shouldfail=False, shouldstop=False, deselected=deselected)


def test_two_processes_share_the_tests_out_as_they_go_each_run_once_a_group_together(tmp_path):
    """The quick timing lane's two processes (tests/support/shard.py): each test runs once, an
    xdist_group's tests in one process one after the other (their setup once), and a process held
    by a long test takes fewer of the rest. Each takes its next unit before the last test of the
    one it runs, and tells that test what comes next (its teardown keeps what both need)."""
    path = Path("test_m.py")
    items = [item(path, name=f"t{i}") for i in range(6)]
    items[2:2] = [item(path, name="g1", group="m")]
    items.append(item(path, name="g2", group="m"))  # the group's tests apart in collection order
    first: list = []
    second: list = []

    def run_first(test, nextitem):
        first.append((test.nodeid.split("::")[1], nextitem and nextitem.nodeid.split("::")[1]))
        if len(first) == 1:  # a long test: the second process runs all it can meanwhile
            shard.run_shared(other, str(tmp_path))

    def run_second(test, nextitem):
        second.append((test.nodeid.split("::")[1], nextitem and nextitem.nodeid.split("::")[1]))

    this = fake_session(items, run_first)
    other = fake_session(items, run_second)
    shard.run_shared(this, str(tmp_path))
    # t0 is the first's; before running it (its unit's last test) the first took the next unit, t1.
    assert first == [("t0", "t1"), ("t1", None)]
    assert second == [("g1", "g2"), ("g2", "t2"), ("t2", "t3"), ("t3", "t4"), ("t4", "t5"), ("t5", None)]
    ran_first = [name for name, _ in first]
    ran_second = [name for name, _ in second]
    assert sorted(ran_first + ran_second) == sorted(test.nodeid.split("::")[1] for test in items)
    assert [test.nodeid.split("::")[1] for test in this.deselected] == ["g1", "t2", "t3", "t4", "t5", "g2"]
    assert [test.nodeid.split("::")[1] for test in other.deselected] == ["t0", "t1"]


# Each test waits until three processes run one, or gives up after 30 s: they pass only if the
# session's tests ran in three processes at once. Six of them: a process takes its next test before
# it runs one (tests/support/shard.py), so two processes hold four of them at most.
AT_ONCE = textwrap.dedent("""\
    import os
    import time

    import pytest

    def meet(name):
        here = os.environ["RAN"]
        with open(os.path.join(here, f"{name} {os.getpid()}"), "w"):
            pass
        deadline = time.monotonic() + 30
        while len({entry.split()[1] for entry in os.listdir(here)}) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        print("uncaptured output of", name)

    @pytest.mark.parametrize("i", range(6))
    def test_meets_the_others(i):
        meet(f"test{i}")
        assert len({entry.split()[1] for entry in os.listdir(os.environ["RAN"])}) == 3

    def test_fails():
        meet("failing")
        assert False, "the failure of a forked process's test"
""")


def run_shared_session(tmp_path: Path, shares: int) -> tuple[subprocess.CompletedProcess, list[str]]:
    (tmp_path / "test_at_once.py").write_text(AT_ONCE)
    ran = tmp_path / "ran"
    ran.mkdir()
    share = tmp_path / "share"
    share.mkdir()
    env = {**os.environ, "RAN": str(ran), shard.SHARE_ENV: str(share), shard.SHARES_ENV: str(shares)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-s",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.support.shard",
            str(tmp_path),
        ],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    return done, sorted(os.listdir(ran))


def test_processes_forked_at_the_first_test_share_the_tests_out_and_their_reports_and_failures_are_the_sessions(
    tmp_path,
):
    """MILI_TESTS_SHARES=3: one process collects and forks two others, which run tests of its
    collection at the same time as it (each test here waits for the three); each test runs once, in
    one of three processes; the forked processes' reports, and what their tests wrote, come in the
    session's report, and a test failed in any of them fails the session."""
    done, ran = run_shared_session(tmp_path, shares=3)
    assert done.returncode == pytest.ExitCode.TESTS_FAILED, done.stdout + done.stderr
    assert sorted(entry.split()[0] for entry in ran) == ["failing"] + [f"test{i}" for i in range(6)]
    assert len({entry.split()[1] for entry in ran}) == 3
    assert done.stdout.count("a forked process: exit status") == 2, done.stdout
    assert "the failure of a forked process's test" in done.stdout
    assert done.stdout.count("uncaptured output of ") == 7
    assert done.stdout.count(" deselected in ") == 3  # a summary each, each of the tests the others ran


def test_without_a_share_folder_pytest_runs_every_test_itself(monkeypatch):
    monkeypatch.delenv(shard.SHARE_ENV, raising=False)
    assert shard.pytest_runtestloop(SimpleNamespace()) is None


def test_the_quick_run_shares_its_waiting_and_timing_tests_out_among_forked_processes_and_the_full_run_does_not():
    """Nothing runs beside a timing test in CI's run, and its waiting tests end minutes before the
    others; in the quick run each of both lanes is one process that collects and forks the others
    (tests/support/shard.py), mostly asleep: three for the waiting tests, four for the timing tests,
    where pytest-xdist's controller and workers each imported torch and collected."""
    script = TEST_SH.read_text()
    assert "\nwaits_processes=1\n" in script
    assert "\ntiming_processes=1\n" in script
    quick = [line.strip() for line in quick_branch(script).splitlines() if "_processes=" in line]
    assert quick == ["waits_processes=3", "timing_processes=4"]
    assert 'shared_by "$waits_processes" waits_env' in script
    assert 'shared_by "$timing_processes" timing_env' in script
    assert script.count("-n 2 --dist loadgroup") == 1  # the other tests' lane alone runs on pytest-xdist
