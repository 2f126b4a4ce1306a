"""A stage's PASS/FAIL table and its figures, rewritten under OUTDIR after every step. Each pytest
step's row says how many of its device tests ran on the GPU, on the CPU, or skipped and why; a
rehearsal's verdict says it is one: its device tests never run on a GPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

from scripts.acceptance.outcome import Result
from scripts.acceptance.step import Outcome, Stage


class StageReport:
    def __init__(self, stage: Stage, rehearse: bool, machine: dict, out: Path):
        self.stage, self.rehearse, self.machine, self.out = stage, rehearse, machine, out
        self.started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        self.results: list[Result] = []

    def add(self, result: Result) -> None:
        self.results.append(result)
        (self.out / f"{self.stage.name}.md").write_text(self.render() + "\n")
        (self.out / f"{self.stage.name}.json").write_text(json.dumps(self.as_json(), indent=1) + "\n")

    def passed(self) -> bool:
        return all(r.outcome in (Outcome.PASS, Outcome.SKIP_NO_CUDA, Outcome.SKIP_FEW_GPUS) for r in self.results)

    def verdict(self) -> str:
        counts = {}
        for r in self.results:
            counts[r.outcome.value] = counts.get(r.outcome.value, 0) + 1
        tally = ", ".join(f"{n} {outcome}" for outcome, n in counts.items())
        verdict = "PASS" if self.passed() else "FAIL"
        return f"rehearsal {verdict}, nothing run on a GPU ({tally})" if self.rehearse else f"{verdict} ({tally})"

    def header(self) -> list[str]:
        m = self.machine
        where = (
            "REHEARSAL on the CPU at tiny shapes: SKIP (no CUDA) marks what only a GPU runs, no device test "
            "runs on a GPU, and its figures are not GPU figures"
            if self.rehearse
            else f"on {m['gpus']} x {m['device']}"
        )
        return [
            f"## GPU acceptance, stage `{self.stage.name}`: {self.stage.what}",
            "",
            f"{where}; torch {m['torch']}, triton {m['triton']}, CUDA {m['cuda_version']}; started {self.started}",
        ]

    def step_rows(self) -> list[str]:
        rows = ["| step | result | seconds | device tests | detail | what |", "|---|---|---|---|---|---|"]
        for r in self.results:
            cells = (r.step.name, r.outcome.value, f"{r.seconds:.0f}", device_tests(r), r.detail, r.step.what)
            rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
        return rows

    def figure_rows(self) -> list[str]:
        rows = []
        for r in self.results:
            for figure in r.step.figures:
                value = r.figures.get(figure.label)
                if value is None:
                    continue
                if figure.target is None:
                    verdict = "-"
                elif self.rehearse:
                    verdict = "n/a (rehearsal)"
                else:
                    verdict = figure.verdict(value)
                rows.append(f"| {r.step.name} | {figure.label} | {value} | {figure.target or '-'} | {verdict} |")
        if not rows:
            return []
        return ["", "| step | figure | value | target | verdict |", "|---|---|---|---|---|", *rows]

    def render(self) -> str:
        footer = f"stage {self.stage.name}: {self.verdict()}; log: {self.out / (self.stage.name + '.log')}"
        return "\n".join([*self.header(), "", *self.step_rows(), *self.figure_rows(), "", footer])

    def as_json(self) -> dict:
        return {
            "stage": self.stage.name,
            "rehearsal": self.rehearse,
            "machine": self.machine,
            "started": self.started,
            "passed": self.passed(),
            "steps": [
                {
                    "name": r.step.name,
                    "outcome": r.outcome.value,
                    "seconds": round(r.seconds, 1),
                    "detail": r.detail,
                    "tests": r.tests.as_json() if r.tests else None,
                    "figures": r.figures,
                }
                for r in self.results
            ],
        }


def device_tests(result: Result) -> str:
    """The row's device tests: where they ran, and why those that skipped did; '-' for a step that ran no tests."""
    if result.tests is None:
        return "-"
    device = result.tests.device
    if result.step.host_only:
        return f"host only: {device.summary()}" if device.total else "host only"
    return device.summary() if device.total else "none"
