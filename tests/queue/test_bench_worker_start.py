"""harness.processes.start_worker, the one way a benchmark starts a worker process: from another
source tree (a worktree of an older commit) it runs that tree's `worker`, from that tree, with only
that tree on PYTHONPATH and that tree's own python if it has one, with the caller's flags last and
its output in the log file; started through bench/device_pace.py, that tree's worker with its echo
steps paced like a GPU's. A stand-in `worker` package in the other tree writes down what it got,
so no real worker starts."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from bench import device_pace
from harness.processes import start_worker

STAND_IN = """import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "pythonpath": os.environ["PYTHONPATH"],
                  "python": sys.executable, "var": os.environ.get("MILI_TEST_VAR")}))
"""


def other_tree(root: Path) -> Path:
    (root / "worker").mkdir(parents=True)
    (root / "worker" / "__init__.py").write_text("")
    (root / "worker" / "__main__.py").write_text(STAND_IN)
    return root


def run(tree: Path, log_path: Path, *flags: str, **kwargs) -> dict:
    worker = start_worker("redis://127.0.0.1:1", "q", *flags, log_path=log_path, tree=tree, **kwargs)
    assert worker.wait(timeout=30) == 0, log_path.read_text()
    return json.loads(log_path.read_text())


def test_another_tree_runs_its_own_worker_from_itself_with_the_callers_flags_last(tmp_path):
    tree = other_tree(tmp_path / "old")
    got = run(tree, tmp_path / "w.log", "--max-running", "4", name="w1", env={"MILI_TEST_VAR": "set"})
    assert got == {
        "argv": [
            *("serve", "--model", "echo", "--redis", "redis://127.0.0.1:1"),
            *("--metrics-host", "127.0.0.1", "--metrics-port", "0", "--queue", "q", "--name", "w1"),
            *("--log-level", "WARNING", "--max-running", "4"),
        ],
        "cwd": str(tree),
        "pythonpath": str(tree),
        "python": sys.executable,
        "var": "set",
    }


def test_another_tree_with_a_venv_runs_that_venvs_python(tmp_path):
    tree = other_tree(tmp_path / "old")
    (tree / ".venv" / "bin").mkdir(parents=True)
    os.symlink(sys.executable, tree / ".venv" / "bin" / "python")
    got = run(tree, tmp_path / "w.log", model="tiny")
    assert got["python"] == str(tree / ".venv" / "bin" / "python")
    assert got["argv"][:3] == ["serve", "--model", "tiny"]
    assert "--name" not in got["argv"]  # no name: the worker names itself, as in a container


PACED_STAND_IN = """import json, sys, time

from worker.engine.echo import EchoEngine


def main(argv):
    engine = EchoEngine()
    started = time.monotonic()
    engine.step()
    engine.step()  # waits out the first step's device time
    print(json.dumps({"argv": argv, "two_steps_s": time.monotonic() - started, "path": sys.path}))
    return 0
"""
ONE_REQUEST_ENGINE = "class EchoEngine:\n    def step(self):\n        return ['one output']\n"


def test_a_tree_started_through_device_pace_runs_its_own_worker_with_its_echo_steps_paced(tmp_path):
    tree = tmp_path / "old"
    (tree / "worker" / "engine").mkdir(parents=True)
    (tree / "worker" / "__init__.py").write_text("")
    (tree / "worker" / "__main__.py").write_text(PACED_STAND_IN)
    (tree / "worker" / "engine" / "__init__.py").write_text("")
    (tree / "worker" / "engine" / "echo.py").write_text(ONE_REQUEST_ENGINE)
    launcher = (str(Path(device_pace.__file__)), "300", "constant")
    got = run(tree, tmp_path / "w.log", "--max-running", "4", launcher=launcher)
    assert got["argv"][:5] == ["serve", "--model", "echo", "--redis", "redis://127.0.0.1:1"]
    assert got["argv"][-2:] == ["--max-running", "4"]
    assert got["two_steps_s"] >= 0.3  # the second step waited for the first's 300 ms on the "device"
    assert got["path"][0] == str(tree)  # bench/ left sys.path: the tree's packages are imported
