"""Runs one stage's steps in order, each under its timeout and within the stage's time, and keeps
the stage's log, table and figures under OUTDIR up to date after every step (a device command cut
off at its limit still leaves them)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.acceptance.outcome import Result, judge, read_figures
from scripts.acceptance.pytest_report import PytestCounts
from scripts.acceptance.report import StageReport
from scripts.acceptance.step import Kind, Outcome, Stage, Step

log = logging.getLogger("acceptance")

REHEARSAL_ENV = {"CUDA_VISIBLE_DEVICES": ""}  # a rehearsal is the CPU's, even on a GPU host
MIN_STEP_S = 20  # less time than this left in the stage: the step is not started
PROBE = """
import json, platform, torch, triton
cuda = torch.cuda.is_available()
print(json.dumps({
    "cuda": cuda, "gpus": torch.cuda.device_count(), "torch": torch.__version__, "triton": triton.__version__,
    "cuda_version": torch.version.cuda,
    "device": torch.cuda.get_device_name() if cuda else f"CPU ({platform.processor() or platform.machine()})",
}))
"""


@dataclass(frozen=True)
class Run:
    """What every step of this run shares."""

    rehearse: bool
    out: Path
    env: dict[str, str]
    machine: dict  # PROBE's answer

    @property
    def cuda(self) -> bool:
        return self.machine["cuda"]

    @property
    def gpus(self) -> int:
        return self.machine["gpus"]

    @classmethod
    def prepare(cls, rehearse: bool, out: Path) -> Run:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if rehearse:
            env.update(REHEARSAL_ENV)
        # Probed in a child: CUDA initialized here would hold device memory the steps size their KV pools from.
        probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True)
        if probe.returncode != 0:
            raise SystemExit(f"{sys.executable} cannot import torch and triton:\n{probe.stderr[-2000:]}")
        out.mkdir(parents=True, exist_ok=True)
        return cls(rehearse, out.resolve(), env, json.loads(probe.stdout))


def command_of(step: Step, run: Run, junit: Path) -> list[str] | None:
    template = step.rehearsal if run.rehearse else step.command
    if template is None:
        return None
    command = [part.format(python=sys.executable, out=run.out) for part in template]
    return command + [f"--junitxml={junit}"] if step.kind is Kind.PYTEST else command


def execute(command: list[str], env: dict[str, str], timeout_s: float, log_file) -> tuple[int | None, str]:
    """(exit status, or None on a timeout; output), the output copied to the log as it comes."""
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    lines: list[str] = []
    reader = threading.Thread(target=copy_lines, args=(process.stdout, log_file, lines), daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        # The step's whole process group goes, also when the runner itself is stopped (SIGTERM, see
        # __main__): what it left running would hold the GPU, or the pipe open.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    reader.join()
    return returncode, "".join(lines)


def copy_lines(stream, log_file, lines: list[str]) -> None:
    for line in stream:
        lines.append(line)
        log_file.write(line)
        log_file.flush()


def step_env(step: Step, run: Run) -> dict[str, str]:
    """The step's variables over the run's; a step that narrows the GPUs it sees does not widen a rehearsal's."""
    return {**run.env, **step.env, **(REHEARSAL_ENV if run.rehearse else {})}


def run_step(step: Step, run: Run, left_s: float, log_file) -> Result:
    """Runs `step` for at most its timeout, or the `left_s` seconds left of its stage's budget."""
    timeout_s = min(step.timeout_s, left_s)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = command_of(step, run, junit)
        if command is None:
            return Result(step, Outcome.SKIP_NO_CUDA, "runs only on a GPU")
        if not run.rehearse and run.gpus < step.gpus:
            return Result(step, Outcome.SKIP_FEW_GPUS, f"needs {step.gpus} GPUs, {run.gpus} visible")
        if step.tool and not run.rehearse and not shutil.which(step.tool, path=run.env.get("PATH")):
            return Result(step, Outcome.FAIL, f"{step.tool} is not on PATH")
        log_file.write(f"\n===== {step.name}: {' '.join(command)}\n")
        log_file.flush()
        start = time.monotonic()
        returncode, output = execute(command, step_env(step, run), timeout_s, log_file)
        seconds = time.monotonic() - start
        if returncode is None:
            why = (
                f"timed out after {timeout_s:.0f} s"
                if timeout_s == step.timeout_s
                else f"stopped after {timeout_s:.0f} s, the end of the stage's budget: rerun with --only {step.name}"
            )
            return Result(step, Outcome.FAIL, why, seconds)
        counts = PytestCounts.from_junit(junit) if step.kind is Kind.PYTEST and junit.exists() else None
        outcome, detail = judge(step, returncode, counts, output, run.cuda)
    figures, missing = read_figures(step, output, run.cuda)
    if outcome is Outcome.PASS and missing:
        outcome, detail = Outcome.FAIL, f"not in its output: {', '.join(missing)}"
    return Result(step, outcome, detail, seconds, figures, counts)


def run_stage(stage: Stage, run: Run, only: set[str] | None) -> bool:
    """True when no step failed."""
    report = StageReport(stage, run.rehearse, run.machine, run.out)
    deadline = time.monotonic() + stage.budget_s
    stopped_by = None
    with (run.out / f"{stage.name}.log").open("w") as log_file:
        for step in stage.steps:
            if only is not None and step.name not in only:
                continue
            left = deadline - time.monotonic()
            if stopped_by is not None:
                result = Result(step, Outcome.NOT_RUN, f"{stopped_by} failed first")
            elif left < MIN_STEP_S:
                result = Result(
                    step, Outcome.NOT_RUN, f"out of the stage's {stage.budget_s} s: rerun with --only {step.name}"
                )
            else:
                log.info("[%s] %s: %s ...", stage.name, step.name, step.what)
                try:
                    result = run_step(step, run, left, log_file)
                except SystemExit:  # stopped from outside (a session's deadline): the table says where
                    report.add(Result(step, Outcome.FAIL, f"stopped from outside: rerun with --only {step.name}"))
                    print(report.render())
                    raise
            if result.outcome is Outcome.FAIL and step.gate:
                stopped_by = step.name
            log.info("[%s] %s: %s %s", stage.name, step.name, result.outcome.value, result.detail)
            report.add(result)
    print(report.render())
    return report.passed()
