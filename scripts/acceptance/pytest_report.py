"""What a pytest step ran, read from its JUnit report: the tests passed, failed and skipped (with
their reasons), and of its device tests (tests/support/devices.py: the JUnit property `device`)
how many ran on the GPU, how many on the CPU's stand-in, and why the others skipped."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from xml.etree import ElementTree

DEVICE_PROPERTY = "device"  # tests/support/devices.py's PROPERTY
SHOWN_FAILURES = 3


class Where(str, Enum):
    """The value of a device test's `device` property."""

    CUDA = "cuda"  # its process saw the GPUs it asks for
    CPU = "cpu"  # it did not: the test skipped, or ran on the CPU's stand-in


@dataclass(frozen=True)
class DeviceCounts:
    on_gpu: int = 0  # ran (passed or failed) where their process saw the GPUs they ask for
    on_cpu: int = 0  # ran on the CPU's stand-in
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> device tests

    @property
    def total(self) -> int:
        return self.on_gpu + self.on_cpu + self.skipped.total()

    def summary(self) -> str:
        parts = [f"{self.on_gpu} on the GPU"]
        if self.on_cpu:
            parts.append(f"{self.on_cpu} on the CPU")
        if self.skipped:
            parts.append(f"{self.skipped.total()} skipped: {reasons(self.skipped)}")
        return ", ".join(parts)

    def as_json(self) -> dict:
        return {"on_gpu": self.on_gpu, "on_cpu": self.on_cpu, "skipped": dict(self.skipped)}


@dataclass(frozen=True)
class PytestCounts:
    passed: int
    failed: list[str]  # names of failed or erroring tests
    skipped: Counter[str]  # reason -> tests
    device: DeviceCounts

    @classmethod
    def from_junit(cls, path: Path) -> PytestCounts:
        passed, failed, skipped = 0, [], Counter()
        ran_on, device_skipped = Counter(), Counter()
        for case in ElementTree.parse(path).iter("testcase"):
            where, reason = device_of(case), skip_reason(case)
            if reason is not None:
                skipped[reason] += 1
                if where is not None:
                    device_skipped[reason] += 1
                continue
            ran_on[where] += 1
            if failed_or_erred(case):
                failed.append(case.get("name", "?"))
            else:
                passed += 1
        device = DeviceCounts(ran_on[Where.CUDA], ran_on[Where.CPU], device_skipped)
        return cls(passed, failed, skipped, device)

    @property
    def only_device_tests_skipped(self) -> bool:
        """Nothing ran, and every test that did not is a device test (so: for want of its GPUs)."""
        return self.passed == 0 and not self.failed and self.skipped == self.device.skipped

    def summary(self) -> str:
        parts = [f"{self.passed} passed"]
        if self.failed:
            shown = ", ".join(self.failed[:SHOWN_FAILURES]) + (", ..." if len(self.failed) > SHOWN_FAILURES else "")
            parts.append(f"{len(self.failed)} failed: {shown}")
        if self.skipped:
            parts.append(f"{self.skipped.total()} skipped")
        return ", ".join(parts)

    def as_json(self) -> dict:
        return {
            "passed": self.passed,
            "failed": self.failed,
            "skipped": dict(self.skipped),
            "device": self.device.as_json(),
        }


def failed_or_erred(case: ElementTree.Element) -> bool:
    return case.find("failure") is not None or case.find("error") is not None


def skip_reason(case: ElementTree.Element) -> str | None:
    """Why the test skipped; None for one that ran (a skipped test whose teardown erred failed)."""
    skip = case.find("skipped")
    return None if skip is None or failed_or_erred(case) else skip.get("message", "")


def device_of(case: ElementTree.Element) -> Where | None:
    """Where a device test ran; None for the others. A value this module does not know is an error."""
    for prop in case.iter("property"):
        if prop.get("name") == DEVICE_PROPERTY:
            return Where(prop.get("value"))
    return None


def reasons(skipped: Counter[str]) -> str:
    return "; ".join(f"{reason or 'no reason given'} ({n})" for reason, n in skipped.most_common())
