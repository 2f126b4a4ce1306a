"""scripts/gpu_acceptance.sh --rehearse: every stage runs on the CPU at tiny shapes through the same
scripts and tests as on the GPU, and its table says SKIP (no CUDA), never PASS, for what only a GPU
can run. This keeps the GPU session's script from rotting between GPU sessions."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

from scripts.acceptance.stages import ORDER, stages
from scripts.acceptance.step import Kind

ROOT = Path(__file__).resolve().parents[2]
DEVICE_FILES_LIMIT = 8  # files a device command can bring back


@pytest.mark.slow
@pytest.mark.parametrize("name", ORDER)
def test_the_rehearsal_of_each_stage_passes_and_skips_only_what_needs_cuda(name, tmp_path):
    done = subprocess.run(
        ["scripts/gpu_acceptance.sh", "--rehearse", name, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    stage = stages()[name]
    report = json.loads((tmp_path / f"{name}.json").read_text())
    assert report["rehearsal"] and report["passed"] and not report["machine"]["cuda"]
    outcomes = {step["name"]: step["outcome"] for step in report["steps"]}
    assert list(outcomes) == [step.name for step in stage.steps]
    for step in stage.steps:
        needs_cuda = step.rehearsal is None or (step.kind is Kind.PYTEST and step.cuda_only)
        assert outcomes[step.name] == ("SKIP (no CUDA)" if needs_cuda else "PASS"), step.name
        found = next(s for s in report["steps"] if s["name"] == step.name)["figures"]
        assert {f.label for f in step.figures if not f.cuda_only} <= found.keys()
    table = (tmp_path / f"{name}.md").read_text()
    assert table.strip().splitlines()[-1].startswith(f"stage {name}: PASS")
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
