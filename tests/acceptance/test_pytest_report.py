"""scripts/acceptance/pytest_report.py: a pytest step's JUnit report read into what ran, failed and
skipped (with the reasons), and where its device tests (tests/support/devices.py) ran. The plugin
that writes where in a real pytest run: tests/acceptance/test_runner.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from scripts.acceptance.pytest_report import DeviceCounts, PytestCounts


def case(name: str, state: str = "passed", device: str | None = None, reason: str = "needs a CUDA device") -> str:
    """One <testcase> as pytest's JUnit writer makes it; `device`: the plugin's property."""
    properties = f'<properties><property name="device" value="{device}"/></properties>' if device else ""
    body = {
        "passed": "",
        "failed": '<failure message="assert 1 == 2">trace</failure>',
        "error": '<error message="failed on setup">trace</error>',
        "skipped": f'<skipped type="pytest.skip" message="{reason}">tests/x.py:3: {reason}</skipped>',
    }[state]
    return f'<testcase classname="tests.x" name="{name}" time="0.1">{properties}{body}</testcase>'


def counts_of(tmp_path: Path, *cases: str) -> PytestCounts:
    path = tmp_path / "junit.xml"
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>'
    )
    return PytestCounts.from_junit(path)


def test_failed_tests_are_named_and_skipped_ones_counted_by_reason(tmp_path):
    counts = counts_of(
        tmp_path,
        case("p0"),
        case("p1"),
        *(case(f"f{i}", "failed") for i in range(3)),
        case("e0", "error"),
        case("s0", "skipped", reason="this host has no address but loopback"),
        case("s1", "skipped", reason="graph capture needs a CUDA device"),
        case("s2", "skipped", reason="graph capture needs a CUDA device"),
    )
    assert (counts.passed, counts.failed) == (2, ["f0", "f1", "f2", "e0"])
    assert counts.skipped == Counter(
        {"graph capture needs a CUDA device": 2, "this host has no address but loopback": 1}
    )
    assert counts.device == DeviceCounts()
    assert counts.summary() == "2 passed, 4 failed: f0, f1, f2, ..., 3 skipped"


def test_device_tests_are_counted_where_they_ran_and_by_why_they_skipped(tmp_path):
    counts = counts_of(
        tmp_path,
        case("host"),
        case("host-skipped", "skipped", reason="on a GPU, the test below counts the compiles themselves"),
        case("gpu-0", device="cuda"),
        case("gpu-1", "failed", device="cuda"),
        case("stand-in", device="cpu"),
        case("two-gpus", "skipped", device="cpu", reason="tensor parallelism on CUDA needs 2 GPUs"),
        case("graphs-0", "skipped", device="cpu", reason="graph capture needs a CUDA device"),
        case("graphs-1", "skipped", device="cpu", reason="graph capture needs a CUDA device"),
    )
    assert counts.device == DeviceCounts(
        on_gpu=2,
        on_cpu=1,
        skipped=Counter({"graph capture needs a CUDA device": 2, "tensor parallelism on CUDA needs 2 GPUs": 1}),
    )
    assert counts.device.total == 6
    assert counts.device.summary() == (
        "2 on the GPU, 1 on the CPU, 3 skipped: graph capture needs a CUDA device (2); "
        "tensor parallelism on CUDA needs 2 GPUs (1)"
    )
    assert counts.as_json()["device"] == {
        "on_gpu": 2,
        "on_cpu": 1,
        "skipped": {"graph capture needs a CUDA device": 2, "tensor parallelism on CUDA needs 2 GPUs": 1},
    }
    assert not counts.only_device_tests_skipped


def test_only_device_tests_skipped_means_nothing_ran_and_every_skip_is_a_device_tests(tmp_path):
    device_skip = case("graphs", "skipped", device="cpu")
    assert counts_of(tmp_path, device_skip).only_device_tests_skipped
    assert not counts_of(tmp_path, device_skip, case("host", "skipped")).only_device_tests_skipped
    assert not counts_of(tmp_path, device_skip, case("stand-in", device="cpu")).only_device_tests_skipped


def test_a_device_property_of_an_unknown_value_is_refused(tmp_path):
    with pytest.raises(ValueError, match="'gpu' is not a valid Where"):
        counts_of(tmp_path, case("t", device="gpu"))
