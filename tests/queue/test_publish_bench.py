"""bench.publish's producers and readers of a case run with the client of the tree measured (a
worktree of an older commit too), in a process of their own: that tree first on sys.path and
PYTHONPATH, started in it. A stand-in `producer_client` in the other tree writes down where it was
imported from and stops, so no Redis or worker is needed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import publish

STAND_IN = """import json, os, sys
print("ready " + json.dumps({"client": __file__, "path0": sys.path[0], "pythonpath": os.environ["PYTHONPATH"],
                             "cwd": os.getcwd()}), flush=True)
sys.exit(0)
"""
ARGS = argparse.Namespace(jobs=2, tokens=4, per_job_jobs=2, producers=1)


def other_tree(root: Path) -> Path:
    (root / "producer_client").mkdir(parents=True)
    (root / "producer_client" / "__init__.py").write_text(STAND_IN)
    return root


def test_a_trees_readers_run_with_that_trees_client(tmp_path):
    tree = other_tree(tmp_path / "old")
    jobs = publish.start_jobs(tree, "unix:///nowhere.sock", tmp_path / "jobs.json", "streamed-gpu", ARGS)
    line, _ = jobs.communicate(timeout=60)
    got = json.loads(line.removeprefix("ready "))
    assert got == {
        "client": str(tree / "producer_client" / "__init__.py"),
        "path0": str(tree),
        "pythonpath": str(tree),
        "cwd": str(tree),
    }


def test_producers_running_another_trees_client_are_refused(tmp_path):
    tree = other_tree(tmp_path / "old")
    jobs = publish.start_jobs(tree, "unix:///nowhere.sock", tmp_path / "jobs.json", "streamed", ARGS)
    with pytest.raises(AssertionError, match="run the client at"):
        publish.wait_ready(jobs, tmp_path / "new", worker=None)  # type: ignore[arg-type]
    jobs.wait(timeout=60)
