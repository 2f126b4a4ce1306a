"""scripts/test.sh gives the `waits` and `timing` lanes only the modules whose text names their mark
(collecting the whole tree cost each of their processes ~5 s more CPU), and deselects both marks
from the others: a test marked from outside its module would run in no lane, so the collection
refuses it (tests/support/tiers.py). With --quick no lane collects the folders whose every test is
of a tier it leaves out."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.tiers import CHAOS_DIRS, E2E_DIRS, marked_outside_their_module

TEST_SH = Path(__file__).resolve().parents[2] / "scripts" / "test.sh"


def item(path: Path, *marks: str) -> SimpleNamespace:
    found = {mark: getattr(pytest.mark, mark).mark for mark in marks}
    return SimpleNamespace(path=path, nodeid=f"{path.name}::test", get_closest_marker=found.get)


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
