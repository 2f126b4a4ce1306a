"""scripts/test.sh runs the suite with `pytest-xdist --dist loadgroup`, and tests/support/tiers.py puts
the tests that share a costly module fixture (worker processes, the 32K engine run) in one
xdist_group, so that the fixture runs once. Nothing fails when grouping silently stops working (it
did under pytest 9 with xdist 3.8: the fixtures ran on both processes, the suite only slower), so a
small session checks that it works with the pytest and xdist installed."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

GROUPED = textwrap.dedent("""
    import os
    import pytest

    pytestmark = pytest.mark.xdist_group("shared")

    @pytest.fixture(scope="module")
    def costly():
        with open(os.environ["SETUPS"], "a") as f:
            f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

    @pytest.mark.parametrize("i", range(6))
    def test_shares_the_fixture(costly, i):
        pass
""")
OTHERS = "import pytest\n\n@pytest.mark.parametrize('i', range(6))\ndef test_alone(i):\n    pass\n"


def test_an_xdist_group_runs_on_one_process_and_its_module_fixture_once(tmp_path):
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    (tmp_path / "test_others.py").write_text(OTHERS)
    setups = tmp_path / "setups.txt"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "2",
            "--dist",
            "loadgroup",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SETUPS": str(setups)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(setups.read_text().split()) == 1, done.stdout


def test_the_groups_of_this_session_reach_xdist(request):
    """tests/support/tiers.py marks the groups in a collection hook, which must run before xdist's
    reads them: xdist appends a test's group to its node id, and schedules by it."""
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not an xdist --dist loadgroup session (scripts/test.sh runs one)")
    grouped = [item for item in request.session.items if item.get_closest_marker("xdist_group")]
    assert all("@" in item.nodeid for item in grouped), [i.nodeid for i in grouped if "@" not in i.nodeid][:5]


@pytest.fixture(scope="module")
def built_once_a_module() -> object:
    return object()


def test_a_module_fixture_of_its_own_puts_a_modules_tests_in_one_group(built_once_a_module, request):
    """Neither parametrized nor a slow test's, a module fixture still runs once only if the tests
    that use it run on one xdist worker: tests/support/tiers.py groups them by their module."""
    group = request.node.get_closest_marker("xdist_group")
    assert group is not None and group.args == (__name__,)


GROUPS_PRINTED = textwrap.dedent("""
    def pytest_collection_finish(session):
        for item in session.items:
            marker = item.get_closest_marker("xdist_group")
            print("GROUP", marker.args[0] if marker else None)
""")


def test_a_group_set_by_hand_keeps_every_test_of_its_module_in_it(tmp_path):
    """tests/chaos/test_schedules.py groups its schedules with the totals check that reads what
    they added up in their process; the schedules' module fixture (chaos_redis) must not move
    them to a group of their own (tiers.shared_setup_group), away from the check."""
    (tmp_path / "groups_printed.py").write_text(GROUPS_PRINTED)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "tests/chaos/test_schedules.py", "--co", "-q", "-m", ""]
        + ["-p", "no:cacheprovider", "-p", "no:xdist", "-p", "groups_printed"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    groups = [line.split()[1] for line in done.stdout.splitlines() if line.startswith("GROUP ")]
    assert len(groups) == 101 and set(groups) == {"chaos-schedules"}, done.stdout[-2000:]
