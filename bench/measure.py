"""Small measuring helpers shared by the benchmark scripts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run_in(tree: Path, script: str, arguments: str, env: Mapping[str, str] | None = None) -> dict:
    """`one_run(arguments)` of the benchmark file `script`, with `tree`'s code, in a process of its
    own started there (`tree`'s own .venv's python if it has one): the file is run from its path,
    so that a tree that lacks it (an older commit's worktree) can be measured too. Its answer is
    the JSON of the process's last line. `env`: variables set over this process's environment."""
    code = f"import json, runpy; m = runpy.run_path({script!r}); print(json.dumps(m['one_run']({arguments})))"
    python = tree / ".venv" / "bin" / "python"
    out = subprocess.run(
        [str(python) if python.exists() else sys.executable, "-c", code],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        check=True,
    )
    answer: dict = json.loads(out.stdout.strip().splitlines()[-1])
    return answer
