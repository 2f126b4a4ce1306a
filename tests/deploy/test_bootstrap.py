"""scripts/bootstrap.sh on a machine it has set up already: it installs nothing and imports no
torch (an import takes seconds), so that a second scripts/run.sh reaches the demo at once (issue
44.5). It runs from a copy of the checkout's script and pyproject.toml, beside a stand-in
.venv/bin/python that logs what it is asked, runs this Python, and refuses pip."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata

from tests.deploy.support import ROOT

REFUSED = 97  # the stand-in's exit status for pip: nothing here may install


def set_up_copy(tmp_path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> {tmp_path / "calls"}\n'
        f'case "$*" in *"-m pip"*) exit {REFUSED};; esac\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)
    # The stamp of an install done before, as the script writes it.
    stamp = subprocess.run(
        ["bash", "-c", "{ cat pyproject.toml; pwd; .venv/bin/python -VV; } | sha256sum | cut -d' ' -f1"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    (tmp_path / ".venv" / ".mili-demo").write_text(stamp)
    (tmp_path / "calls").unlink()


def test_a_machine_set_up_already_is_ready_without_pip_or_importing_torch(tmp_path):
    # Without them the script would install them (apt-get): the suite's own servers need them anyway.
    assert shutil.which("redis-server") and shutil.which("redis-cli")
    set_up_copy(tmp_path)
    done = subprocess.run(["bash", "scripts/bootstrap.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines() == [
        "[bootstrap] the demo requirements are installed already (pyproject.toml unchanged)",
        f"[bootstrap] ready: torch {metadata.version('torch')} triton {metadata.version('triton')}",
    ]
    calls = (tmp_path / "calls").read_text().splitlines()
    assert not [c for c in calls if "import torch" in c or "-m pip" in c], calls
