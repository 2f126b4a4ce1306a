"""The plain install is the client: `pip install mili` into a fresh virtual environment gives the
client library, the `mili` CLI and the wire models with redis, pydantic and tqdm only. Neither
torch nor the web stack is importable there, and the client and `mili batch` run real jobs
against a worker (which has the worker extra)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

from tests.deploy.support import ROOT
from tests.support.workers import WorkerProcess, start_workers
from worker.embedded_redis import EmbeddedRedis

PACKAGES = [
    p.rstrip("*")
    for p in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
]
SOURCES = ("pyproject.toml", "README.md", "config", *PACKAGES)


def run_installed(command: list, **options) -> subprocess.CompletedProcess:
    """`command` from the venv as a user runs it: without the tests' PYTHONPATH, and away from the
    checkout (`python -c` puts its working directory on sys.path), so it finds only what pip installed."""
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    return subprocess.run(command, env=env, cwd=Path(command[0]).parent, capture_output=True, text=True, **options)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory):
    """A fresh venv with `pip install <the project>`, built from a copy (pip builds in the tree)."""
    root = tmp_path_factory.mktemp("install")
    source = root / "mili"
    source.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, source / name)
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(source)],
        check=True,
        timeout=600,
    )
    return venv / "bin"


@pytest.mark.slow
def test_the_plain_install_needs_neither_torch_nor_the_web_stack(client_venv):
    installed = run_installed(
        [client_venv / "python", "-m", "pip", "list", "--format=freeze"], check=True
    ).stdout.lower()
    names = {line.split("==")[0] for line in installed.splitlines()}
    assert {"mili", "redis", "pydantic"} <= names
    assert not names & {"torch", "triton", "numba", "fastapi", "uvicorn", "pydantic-settings", "prometheus-client"}
    imports = run_installed([client_venv / "python", "-c", "import torch"])
    assert imports.returncode != 0 and "No module named 'torch'" in imports.stderr
    base = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert [d.split(">")[0].split("[")[0] for d in base] == ["redis", "pydantic", "tqdm"]


@pytest.fixture(scope="module")
def echo_queue(tmp_path_factory) -> Iterator[tuple[str, str]]:
    """(a Redis URL, a queue on it that an echo worker serves), for this module's tests that run jobs."""
    queue = f"install-{uuid.uuid4().hex[:6]}"
    with EmbeddedRedis() as server:
        (worker,) = start_workers(
            [WorkerProcess(server.url, queue, queue, tmp_path_factory.mktemp("install-worker"), model="echo")]
        )
        try:
            yield server.url, queue
        finally:
            worker.stop()


@pytest.mark.slow
def test_the_plain_install_runs_jobs_through_a_worker(client_venv, echo_queue):
    url, queue = echo_queue
    code = (
        "import sys; from producer_client import Client; "
        f"c = Client({url!r}, {queue!r}); r = c.generate('plain install', max_tokens=32, timeout=60); "
        "assert 'torch' not in sys.modules; print(r.status, r.text)"
    )
    done = run_installed([client_venv / "python", "-c", code], timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "done plain install"
    stats = run_installed([client_venv / "mili", "--redis", url, "--queue", queue, "stats"], timeout=60)
    assert stats.returncode == 0 and queue in stats.stdout, stats.stderr


@pytest.mark.slow
def test_mili_batch_runs_on_the_plain_install(client_venv, echo_queue, tmp_path):
    url, queue = echo_queue
    lines = tmp_path / "in.jsonl"
    bodies = {"a": {"model": "m", "prompt": "plain batch", "max_tokens": 64}, "b": {"model": "m", "prompt": 1}}
    lines.write_text(
        "".join(
            json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body}) + "\n"
            for cid, body in bodies.items()
        )
    )
    output = tmp_path / "out.jsonl"
    done = run_installed(
        [
            client_venv / "mili",
            "--redis",
            url,
            "--queue",
            queue,
            "batch",
            str(lines),
            "-o",
            str(output),
        ],
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    (answer,) = [json.loads(line) for line in output.read_text().splitlines()]
    assert (answer["custom_id"], answer["response"]["body"]["choices"][0]["text"]) == ("a", "plain batch")
    (refused,) = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert (refused["custom_id"], refused["response"]["status_code"]) == ("b", 400)


@pytest.mark.slow
def test_a_response_format_on_the_plain_install_is_refused_naming_the_extra(client_venv, redis_server):
    queue = f"install-{uuid.uuid4().hex[:6]}"
    code = (
        "from producer_client import Client, InvalidArgument\n"
        f"c = Client({redis_server.url!r}, {queue!r})\n"
        "try:\n    c.submit('x', response_format={'type': 'json_object'})\n"
        "except InvalidArgument as e:\n    print(e.field, e.message)\n"
        f"print(c.redis.xlen('mili:q:{{{queue}}}'))\n"
    )
    done = run_installed([client_venv / "python", "-c", code], timeout=120)
    assert done.returncode == 0, done.stderr
    refused, queued = done.stdout.strip().splitlines()
    assert refused.startswith("response_format response_format: checking a format before it is queued needs")
    assert "pip install 'mili[structured]'" in refused and queued == "0"
