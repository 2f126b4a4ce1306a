"""A finished step's outcome, from its exit status, its JUnit report (pytest steps) and its output.
On a GPU run, a pytest step passes only when some of its device tests ran on the GPU (unless its
tests are the host's alone): tests that all skipped there, or ran on the CPU, are no GPU pass."""

from __future__ import annotations

from dataclasses import dataclass, field

from scripts.acceptance.pytest_report import PytestCounts, reasons
from scripts.acceptance.step import EXIT_NO_CUDA, Kind, Outcome, Step

Verdict = tuple[Outcome, str]  # the outcome and its detail


@dataclass
class Result:
    step: Step
    outcome: Outcome
    detail: str = ""
    seconds: float = 0.0
    figures: dict[str, str] = field(default_factory=dict)  # label -> value as printed
    tests: PytestCounts | None = None  # a pytest step's, read from its report


def last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def pytest_outcome(step: Step, returncode: int, counts: PytestCounts | None, output: str, cuda: bool) -> Verdict:
    if counts is None:
        return Outcome.FAIL, f"exit status {returncode}, no test report: {last_line(output)}"
    if returncode != 0 or counts.failed:
        # compute-sanitizer fails a run whose tests passed when it found an error: its report is the detail.
        detail = (
            counts.summary() if counts.failed else f"{counts.summary()}; exit status {returncode}: {last_line(output)}"
        )
        return Outcome.FAIL, detail
    if counts.passed == 0:
        if not cuda and counts.only_device_tests_skipped:
            return Outcome.SKIP_NO_CUDA, counts.summary()
        return Outcome.FAIL, f"every test skipped: {reasons(counts.skipped)}"
    if cuda and not step.host_only and counts.device.on_gpu == 0:
        return Outcome.FAIL, f"no device test ran on the GPU: {counts.device.summary()}"
    return Outcome.PASS, counts.summary()


def script_outcome(returncode: int, output: str, cuda: bool) -> Verdict:
    if returncode == 0:
        return Outcome.PASS, ""
    if returncode == EXIT_NO_CUDA and not cuda:
        return Outcome.SKIP_NO_CUDA, last_line(output)
    return Outcome.FAIL, f"exit status {returncode}: {last_line(output)}"


def judge(step: Step, returncode: int, counts: PytestCounts | None, output: str, cuda: bool) -> Verdict:
    """A finished step's outcome and its detail; `counts`: a pytest step's report, None where it wrote none."""
    if step.kind is Kind.PYTEST:
        return pytest_outcome(step, returncode, counts, output, cuda)
    return script_outcome(returncode, output, cuda)


def read_figures(step: Step, output: str, cuda: bool) -> tuple[dict[str, str], list[str]]:
    """({label: value} found, labels a passing step should have printed and did not)."""
    found, missing = {}, []
    for figure in step.figures:
        value = figure.find(output)
        if value is not None:
            found[figure.label] = value
        elif cuda or not figure.cuda_only:
            missing.append(figure.label)
    return found, missing
