"""scripts/bootstrap.sh on a machine it has set up already: it installs nothing and imports no
torch (an import takes seconds), so that a second scripts/run.sh reaches the demo at once (issue
44.5); and on a machine with no GPU and no torch yet, it installs the CPU build of torch, as the
README promises. It runs from a copy of the checkout's script and pyproject.toml, beside a stand-in
.venv/bin/python that logs what it is asked, runs this Python, and refuses pip (or, where the
machine is fresh, takes pip's calls without installing anything)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import metadata

from tests.deploy.support import ROOT

REFUSED = 97  # the stand-in's exit status for pip: nothing here may install


def stand_in_python(tmp_path, pip_exit: int, torch_installed: bool = True) -> None:
    """.venv/bin/python of the copy: logs its arguments, answers pip with `pip_exit`, and says
    whether torch is installed as `torch_installed` has it (the script's look-up names find_spec)."""
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    torch_lookup = "" if torch_installed else "  *find_spec*torch*) exit 1;;\n"
    python.write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$*" >> {tmp_path / "calls"}\ncase "$*" in\n'
        f'  *"-m pip"*) exit {pip_exit};;\n{torch_lookup}esac\nexec {sys.executable} "$@"\n'
    )
    python.chmod(0o755)


def copy_scripts(tmp_path) -> None:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)


def set_up_copy(tmp_path) -> None:
    copy_scripts(tmp_path)
    stand_in_python(tmp_path, pip_exit=REFUSED)
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


def test_a_machine_without_a_gpu_gets_the_cpu_build_of_torch(tmp_path):
    """PyPI's torch for Linux x86_64 is the CUDA build (it pulls several GB of nvidia-* wheels), a
    pinned version too: only PyTorch's CPU index has the CPU build (`+cpu`), which pip prefers
    there to PyPI's wheel of the same version."""
    assert shutil.which("redis-server") and shutil.which("redis-cli")
    copy_scripts(tmp_path)
    stand_in_python(tmp_path, pip_exit=0, torch_installed=False)
    no_gpu = tmp_path / "no-gpu"
    no_gpu.mkdir()
    (no_gpu / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # as where no driver answers
    (no_gpu / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "PATH": f"{no_gpu}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "scripts/bootstrap.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
    torch_installs = [
        c.split() for c in (tmp_path / "calls").read_text().splitlines() if "-m pip" in c and "torch" in c
    ]
    assert len(torch_installs) == 1, torch_installs
    install = torch_installs[0]
    assert "torch==2.13.0" in install
    assert install[install.index("--extra-index-url") + 1] == "https://download.pytorch.org/whl/cpu", install
