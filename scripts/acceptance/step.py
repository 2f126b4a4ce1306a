"""What a stage is made of: steps (a command on the GPU, and its rehearsal on the CPU) and the
figures read from their output."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from enum import Enum

# A script that needs CUDA and finds none exits with this status (automake's "skipped").
EXIT_NO_CUDA = 77
# The KV pool of a rehearsed engine on the CPU: the tiny model's whole context (max_model_len 40,960
# tokens at 4 KiB a token), not EngineSettings' 1 GiB, which each engine zeroes as it starts (0.55 s
# of CPU a GiB; the suite's rehearsals start nine).
TINY_KV_CACHE = ("--kv-cache-mib", "160")


class Outcome(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP_NO_CUDA = "SKIP (no CUDA)"
    SKIP_FEW_GPUS = "SKIP (too few GPUs)"
    NOT_RUN = "NOT RUN"


class Kind(str, Enum):
    PYTEST = "pytest"  # its outcome is read from a JUnit XML report
    SCRIPT = "script"  # 0 passes, EXIT_NO_CUDA skips, anything else fails


COMPARISONS = {">=": operator.ge, "<=": operator.le}


@dataclass(frozen=True)
class Figure:
    """A number printed by a step: `pattern`'s first group. A figure missing from a passing step's
    output fails the step, so a changed print cannot silently drop a figure from the table."""

    label: str
    pattern: str
    target: str | None = None  # ">= 20000": met or missed on the GPU; a rehearsal's numbers are not figures
    cuda_only: bool = False  # printed only where there is a GPU

    def find(self, output: str) -> str | None:
        found = re.search(self.pattern, output, re.MULTILINE)
        return found.group(1) if found else None

    def verdict(self, value: str) -> str:
        if self.target is None:
            return "-"
        op, bound = self.target.split()
        met = COMPARISONS[op](float(value.replace(",", "")), float(bound))
        return "met" if met else "MISSED"


@dataclass(frozen=True)
class Step:
    name: str
    what: str
    kind: Kind
    command: tuple[str, ...]  # on the GPU; {python} and {out} are filled in
    rehearsal: tuple[str, ...] | None  # on the CPU, at tiny shapes; None: only a GPU can run it
    timeout_s: int
    gate: bool = False  # a failure ends the stage: what follows would measure a broken path
    # Its tests are the host's alone (none runs on the device); otherwise a GPU run of it fails unless
    # some of its device tests (tests/support/devices.py) ran on the GPU.
    host_only: bool = False
    gpus: int = 1  # the GPUs its GPU command needs; with fewer it is SKIP (too few GPUs), and rehearsed as usual
    tool: str | None = None  # an executable the GPU command needs
    env: dict[str, str] = field(default_factory=dict)
    figures: tuple[Figure, ...] = ()


def pytest_args(*args: str) -> tuple[str, ...]:
    """The plugin writes where each device test ran into the JUnit report, whatever conftest.py is in effect."""
    return ("{python}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.support.devices", *args)


def tests(name: str, what: str, args: tuple[str, ...], rehearsal: tuple[str, ...] | None = None, **options) -> Step:
    """A pytest run; its rehearsal runs `rehearsal`'s arguments, or the same ones. A rehearsal whose
    tests are all device tests that skipped is SKIP (no CUDA)."""
    return Step(name, what, Kind.PYTEST, pytest_args(*args), pytest_args(*(rehearsal or args)), **options)


def script(name: str, what: str, args: tuple[str, ...], rehearsal: tuple[str, ...] | None, **options) -> Step:
    """A program run as `{python} args...`; rehearsal None: CUDA only, reported SKIP (no CUDA) there."""
    return Step(
        name, what, Kind.SCRIPT, ("{python}", *args), ("{python}", *rehearsal) if rehearsal else None, **options
    )


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    steps: tuple[Step, ...]
    # A device command runs 10 minutes at most, scripts/bootstrap.sh --offline before the stage included.
    budget_s: int = 480
