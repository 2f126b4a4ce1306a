"""A finished step's outcome, from its exit status, its JUnit report (pytest steps) and its output."""

from __future__ import annotations

import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from scripts.acceptance.step import EXIT_NO_CUDA, Kind, Outcome, Step


@dataclass
class Result:
    step: Step
    outcome: Outcome
    detail: str = ""
    seconds: float = 0.0
    figures: dict[str, str] = field(default_factory=dict)  # label -> value as printed


@dataclass(frozen=True)
class PytestCounts:
    passed: int
    failed: list[str]  # names of failed or erroring tests
    skipped: int

    @classmethod
    def from_junit(cls, path: Path) -> PytestCounts:
        passed, failed, skipped = 0, [], 0
        for case in ElementTree.parse(path).iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(case.get("name", "?"))
            elif case.find("skipped") is not None:
                skipped += 1
            else:
                passed += 1
        return cls(passed, failed, skipped)

    def summary(self) -> str:
        parts = [f"{self.passed} passed"]
        if self.failed:
            shown = ", ".join(self.failed[:3]) + (", ..." if len(self.failed) > 3 else "")
            parts.append(f"{len(self.failed)} failed: {shown}")
        if self.skipped:
            parts.append(f"{self.skipped} skipped")
        return ", ".join(parts)


def last_line(output: str) -> str:
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1][:200] if lines else ""


def pytest_outcome(step: Step, returncode: int, junit: Path, output: str, cuda: bool) -> tuple[Outcome, str]:
    if not junit.exists():
        return Outcome.FAIL, f"exit status {returncode}, no test report: {last_line(output)}"
    counts = PytestCounts.from_junit(junit)
    if returncode != 0 or counts.failed:
        # compute-sanitizer fails a run whose tests passed when it found an error: its report is the detail.
        detail = (
            counts.summary() if counts.failed else f"{counts.summary()}; exit status {returncode}: {last_line(output)}"
        )
        return Outcome.FAIL, detail
    if counts.passed == 0 and counts.skipped:
        if cuda and step.cuda_only:
            return Outcome.FAIL, f"all {counts.skipped} skipped on a GPU run"
        return (Outcome.FAIL, "every test skipped") if cuda else (Outcome.SKIP_NO_CUDA, counts.summary())
    return Outcome.PASS, counts.summary()


def script_outcome(returncode: int, output: str, cuda: bool) -> tuple[Outcome, str]:
    if returncode == 0:
        return Outcome.PASS, ""
    if returncode == EXIT_NO_CUDA and not cuda:
        return Outcome.SKIP_NO_CUDA, last_line(output)
    return Outcome.FAIL, f"exit status {returncode}: {last_line(output)}"


def judge(step: Step, returncode: int, junit: Path, output: str, cuda: bool) -> tuple[Outcome, str]:
    if step.kind is Kind.PYTEST:
        return pytest_outcome(step, returncode, junit, output, cuda)
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
