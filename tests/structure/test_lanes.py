"""scripts/test.sh gives the `waits` and `timing` lanes only the modules whose text names their mark
(collecting the whole tree cost each of their processes ~5 s more CPU), and deselects both marks
from the others: a test marked from outside its module would run in no lane, so the collection
refuses it (tests/support/tiers.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.tiers import marked_outside_their_module


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
