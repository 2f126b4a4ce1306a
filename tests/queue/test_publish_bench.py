"""bench.publish's producers and readers of a case run with the client of the tree measured (a
worktree of an older commit too), in a process of their own: that tree first on sys.path and
PYTHONPATH, started in it. A stand-in `producer_client` in the other tree writes down where it was
imported from and stops, so no Redis or worker is needed."""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
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


READERS_STAND_IN = """import sys
class Client:
    def __init__(self, *args, **kwargs): pass
    def __enter__(self): return self
    def __exit__(self, *exc): pass
    def workers(self): return ["worker"]
    def generate(self, *args, **kwargs): pass
    def submit_many(self, specs):
        print("submitted", flush=True)
        sys.exit(0)
class _Redis:
    async def ping(self): print("connection made", flush=True)
class AsyncClient:
    def __init__(self, *args, **kwargs): self.redis = _Redis()
    async def aclose(self): pass
"""


def test_a_streamed_cases_readers_connect_before_the_benchs_readings(tmp_path):
    """The readers' connections (one each) are made before `ready`, after which the bench reads the
    CPU of the worker and redis-server: making them is no token's publication."""
    tree = tmp_path / "tree"
    (tree / "producer_client").mkdir(parents=True)
    (tree / "producer_client" / "__init__.py").write_text(READERS_STAND_IN)
    jobs = publish.start_jobs(tree, "unix:///nowhere.sock", tmp_path / "jobs.json", "streamed-gpu", ARGS)
    before = []
    while not (line := jobs.stdout.readline()).startswith("ready"):
        before.append(line.strip())
    out, _ = jobs.communicate("go\n", timeout=60)
    assert before == ["connection made"] * ARGS.jobs
    assert out.split("\n")[-2] == "submitted"


def test_the_workers_loop_thread_is_its_main_thread_and_the_kernels_share_a_fraction():
    """bench.publish's split of a worker's CPU, read of this process: CPU burnt on the main thread
    is the loop thread's; another thread's beside it is not."""

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    other = threading.Thread(target=burn, args=(0.3,))
    before = publish.worker_threads(os.getpid())
    other.start()
    burn(0.2)
    loop_s, kernel_share = publish.threads_since(os.getpid(), before)
    other.join()
    assert 0.2 <= loop_s < 0.3
    assert 0.0 <= kernel_share <= 1.0
