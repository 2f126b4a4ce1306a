"""docker/Dockerfile without a Docker engine: every file, module, command, port and variable it
names exists in the project, and the build steps that are plain Python run here."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
import tomllib

from tests.deploy.support import (
    DOCKER,
    ROOT,
    dockerignore_excludes,
    known_mili_variables,
    parse_dockerfile,
    read_dockerignore,
    tracked_files,
    worker_commands,
)
from worker.settings import WorkerSettings

INSTRUCTIONS = parse_dockerfile(DOCKER / "Dockerfile")
FINAL_STAGE = max(i.stage for i in INSTRUCTIONS)


def final(keyword: str) -> list:
    return [i for i in INSTRUCTIONS if i.stage == FINAL_STAGE and i.keyword == keyword]


def declared_args() -> dict[str, str]:
    args = {}
    for i in INSTRUCTIONS:
        if i.keyword == "ARG":
            name, _, default = i.args.partition("=")
            args[name] = default
    return args


def env_variables() -> dict[str, str]:
    env = {}
    for i in INSTRUCTIONS:
        if i.keyword == "ENV":
            env.update(pair.split("=", 1) for pair in i.args.split())
    return env


def test_both_stages_start_from_the_base_image_argument():
    froms = [i.args for i in INSTRUCTIONS if i.keyword == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE} AS runtime"]
    base = declared_args()["BASE_IMAGE"]
    assert base.startswith("nvidia/cuda:") and "-runtime-" in base


def test_the_runtime_stage_takes_only_the_venv_from_the_build_stage():
    copies = [i.args for i in final("COPY") if i.args.startswith("--from=")]
    assert copies == ["--from=build /opt/mili /opt/mili"]
    assert env_variables()["PATH"].startswith("/opt/mili/bin:")


def test_runs_as_a_non_root_user():
    users = final("USER")
    assert users and users[-1].args not in ("root", "0")
    # USER comes before the instructions that start processes, so they all run as that user.
    position = INSTRUCTIONS.index(users[-1])
    assert all(INSTRUCTIONS.index(i) > position for i in final("HEALTHCHECK") + final("ENTRYPOINT") + final("CMD"))


@pytest.mark.parametrize(
    "copy", [i for i in INSTRUCTIONS if i.keyword == "COPY" and "--from=" not in i.args], ids=lambda i: i.args
)
def test_copied_sources_exist_and_pass_the_dockerignore(copy):
    *sources, _destination = copy.args.split()
    patterns = read_dockerignore()
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        files = tracked_files(source)
        assert files, f"COPY {source}: nothing tracked by git there (a fresh clone would not have it)"
        left_out = [f for f in files if dockerignore_excludes(patterns, f)]
        assert not left_out, f".dockerignore keeps {left_out} out of the build context"


def test_every_python_package_of_the_project_is_copied():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {i.args.split()[0] for i in final("COPY") if "--from=" not in i.args}
    assert packages <= copied
    # ...to where PYTHONPATH points, and config/ beside them, where worker/settings.py looks.
    assert env_variables()["PYTHONPATH"] == "/app"
    assert "COPY config /app/config" in [f"COPY {i.args}" for i in final("COPY")]


def test_the_dependency_step_reads_the_requirements_from_pyproject(tmp_path):
    """Runs the build stage's Python one-liner on the repository's pyproject.toml."""
    run = next(i for i in INSTRUCTIONS if i.keyword == "RUN" and "tomllib" in i.args)
    script = re.search(r"python3 -c '([^']*)'", run.args).group(1)
    result = subprocess.run(
        [sys.executable, "-c", script.replace("/tmp/pyproject.toml", str(ROOT / "pyproject.toml"))],
        capture_output=True,
        text=True,
        check=True,
    )
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # The client's dependencies, the worker's and the gateway's extras: the image runs either program.
    extras = project["optional-dependencies"]
    assert result.stdout.split("\n")[:-1] == project["dependencies"] + extras["worker"] + extras["gateway"]


def test_the_entrypoint_is_the_worker_cli():
    assert final("ENTRYPOINT")[-1].exec_form() == ["python", "-m", "worker"]
    assert importlib.util.find_spec("worker.__main__") is not None
    (command,) = final("CMD")[-1].exec_form()
    assert command in worker_commands()


def test_the_healthcheck_runs_the_worker_healthcheck_within_its_timeout():
    (check,) = final("HEALTHCHECK")
    assert check.exec_form() == ["python", "-m", "worker", "healthcheck"]
    assert "healthcheck" in worker_commands()
    timeout_s = float(re.search(r"--timeout=(\d+)s", check.args).group(1))
    # Redis that does not answer reads as unhealthy, not as the check's timeout
    assert timeout_s > WorkerSettings.model_fields["healthcheck_timeout_s"].default


def test_exposes_the_metrics_port_default():
    (expose,) = final("EXPOSE")
    assert int(expose.args) == WorkerSettings.model_fields["metrics_port"].default


def test_in_the_image_metrics_listen_on_every_interface_and_elsewhere_on_loopback_only():
    assert env_variables()["MILI_METRICS_HOST"] == "0.0.0.0"  # Prometheus scrapes a container from outside
    assert WorkerSettings.model_fields["metrics_host"].default == "127.0.0.1"  # a shared host: this host only


def test_the_model_directory_is_a_volume():
    (volume,) = final("VOLUME")
    assert volume.exec_form() == ["/models"]


def test_every_mili_variable_it_sets_is_read_by_the_worker():
    named = {k for k in env_variables() if k.startswith("MILI_")}
    assert named and named <= known_mili_variables()


def test_the_cache_directory_belongs_to_the_worker_user():
    run = next(i.args for i in final("RUN") if "useradd" in i.args)
    assert f"chown mili:mili {env_variables()['MILI_CACHE_DIR']}" in run
    # Compiled kernels are cached under it too: /app, where the code sits, belongs to root.
    for compiler_cache in ("TRITON_CACHE_DIR", "NUMBA_CACHE_DIR"):
        assert env_variables()[compiler_cache].startswith(env_variables()["MILI_CACHE_DIR"] + "/")
