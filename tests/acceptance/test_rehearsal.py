"""scripts/gpu_acceptance.sh --rehearse: every stage runs on the CPU at tiny shapes through the same
scripts and tests as on the GPU, and its table says SKIP (no CUDA), never PASS, for what only a GPU
can run, and where each pytest step's device tests ran (never on a GPU). This keeps the GPU
session's script from rotting between GPU sessions.

The scripts run for real. The tests of a pytest step are collected, marked and reported but not run
(tests/support/not_run.py): they are tests/' own, which this CI run runs for real beside this test,
and what a step adds to them is its plumbing (its selection, its device tests' count, its JSON and
table), which their reports prove. By hand, `scripts/gpu_acceptance.sh --rehearse` runs them."""

from __future__ import annotations

import gzip
import importlib
import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
import torch

from bench.offline import engine_settings
from scripts.acceptance.stages import ORDER, stages
from scripts.acceptance.step import TINY_KV_CACHE, Kind, Step
from tests.support.not_run import SUMMARY
from worker.engine.kv_pool import KVCacheShape
from worker.engine.memory import pages_in_budget
from worker.model.presets import model_config

ROOT = Path(__file__).resolve().parents[2]
DEVICE_FILES_LIMIT = 8  # files a device command can bring back
# tp's worker step rehearses the killed rank alone, whose ranks are the CPU's on a GPU host too; its
# device test (a worker of two GPU ranks serving) runs only there.
REHEARSED_WITHOUT_DEVICE_TESTS = {("tp", "worker")}
NOT_RUN = {**os.environ, "PYTEST_ADDOPTS": f"{os.environ.get('PYTEST_ADDOPTS', '')} -p tests.support.not_run"}


def skipped_for_want_of_cuda(step: Step, found: dict) -> bool:
    """A step only a GPU runs, or tests that are all device tests and all skipped here."""
    if step.rehearsal is None:
        return True
    tests = found["tests"]
    return tests is not None and tests["passed"] == 0 and tests["skipped"] == tests["device"]["skipped"]


# The rehearsed scripts that start engines on the CPU's default pool unless told its size.
ENGINE_BENCHES = ("bench.offline", "bench.serve", "bench.decode_step")


def test_a_rehearsed_engine_pool_holds_the_tiny_models_whole_context_and_no_more(monkeypatch):
    config = model_config("tiny")
    shape = KVCacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, 16, torch.float32)
    pages = pages_in_budget(int(TINY_KV_CACHE[1]) * 2**20, shape.bytes_per_page)
    assert pages * shape.page_size == config.context_length  # no request is refused that the default pool takes
    rehearsed = [step.rehearsal for stage in stages().values() for step in stage.steps if step.rehearsal]
    engines = [args for args in rehearsed if args[2] in ENGINE_BENCHES]
    assert len(engines) == 7
    for args in engines:
        monkeypatch.setattr("sys.argv", [args[2], *(a.replace("{out}", "out") for a in args[3:])])
        parsed = importlib.import_module(args[2]).parse_args()
        # bench.serve's worker takes the same settings as flags.
        assert engine_settings(parsed)["kv_cache_mib"] == int(TINY_KV_CACHE[1]), args


@pytest.mark.slow
@pytest.mark.parametrize("name", ORDER)
def test_the_rehearsal_of_each_stage_passes_and_skips_only_what_needs_cuda(name, tmp_path):
    done = subprocess.run(
        ["scripts/gpu_acceptance.sh", "--rehearse", name, str(tmp_path)],
        cwd=ROOT,
        env=NOT_RUN,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    stage = stages()[name]
    report = json.loads((tmp_path / f"{name}.json").read_text())
    assert report["rehearsal"] and report["passed"] and not report["machine"]["cuda"]
    steps = {step["name"]: step for step in report["steps"]}
    log = (tmp_path / f"{name}.log").read_text()
    assert list(steps) == [step.name for step in stage.steps]
    for step in stage.steps:
        found = steps[step.name]
        assert found["outcome"] == ("SKIP (no CUDA)" if skipped_for_want_of_cuda(step, found) else "PASS"), step.name
        assert {f.label for f in step.figures if not f.cuda_only} <= found["figures"].keys()
        if step.kind is Kind.PYTEST and step.rehearsal is not None:
            tests = found["tests"]
            reported = tests["passed"] + sum(tests["skipped"].values())
            assert SUMMARY.format(reported) in log, step.name  # collected and reported, not run again
            device = tests["device"]
            assert device["on_gpu"] == 0, step.name
            if not step.host_only and (name, step.name) not in REHEARSED_WITHOUT_DEVICE_TESTS:
                # The device tests that a GPU run counts are marked: the rehearsal meets some.
                assert device["on_cpu"] + sum(device["skipped"].values()) > 0, step.name
    table = (tmp_path / f"{name}.md").read_text()
    assert table.strip().splitlines()[-1].startswith(f"stage {name}: rehearsal PASS, nothing run on a GPU")
    assert table.strip() in done.stdout
    assert len(list(tmp_path.iterdir())) <= DEVICE_FILES_LIMIT
    if name == "bench":
        trace = json.loads(gzip.decompress((tmp_path / "decode_trace.json.gz").read_bytes()))
        assert sum(e.get("name") == "engine_step" for e in trace["traceEvents"]) == 5  # --profile-steps 5


@pytest.mark.slow
def test_a_session_runs_its_specs_until_the_deadline_and_brings_back_one_archive(tmp_path):
    # 31 s: the first spec starts (a spec needs 30 s left), the second finds too little time.
    out = tmp_path / "out"
    done = subprocess.run(
        ["scripts/gpu_session.sh", "--rehearse", "31", str(out), "kernels:smoke", "kernels:tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "[session] kernels:smoke: exit 0" in done.stdout
    assert re.search(r"\[session\] kernels:tests: not run, \d+ s left", done.stdout)
    assert sorted(p.name for p in out.iterdir()) == ["acceptance.tgz", "tables.md"]
    tables = (out / "tables.md").read_text()
    assert "| smoke | PASS |" in tables and tables.strip() in done.stdout
    with tarfile.open(out / "acceptance.tgz") as archive:
        names = set(archive.getnames())
    assert {
        "./01-kernels/kernels.md",
        "./01-kernels/kernels.json",
        "./01-kernels/kernels.log",
        "./01-kernels.out",
    } <= names
