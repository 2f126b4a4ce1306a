"""scripts/acceptance: how a step's outcome is judged (exit status, JUnit report, figures), and how
a stage runs (gates, timeouts, its time budget, the files it leaves), on small stand-in steps."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from harness.polling import eventually
from harness.processes import alive
from scripts.acceptance import runner
from scripts.acceptance.outcome import Result, judge, read_figures
from scripts.acceptance.pytest_report import DeviceCounts, PytestCounts
from scripts.acceptance.report import StageReport
from scripts.acceptance.runner import Run, run_stage
from scripts.acceptance.stages import ORDER, stages
from scripts.acceptance.step import EXIT_NO_CUDA, Figure, Kind, Outcome, Stage, Step, script
from scripts.acceptance.step import tests as pytest_step

pytestmark = pytest.mark.waits

ROOT = Path(__file__).resolve().parents[2]
CPU = {"cuda": False, "gpus": 0, "torch": "t", "triton": "t", "cuda_version": None, "device": "CPU (test)"}
GPU = {**CPU, "cuda": True, "gpus": 1, "device": "a stand-in GPU"}


def counts(passed=0, failed=0, skipped=None, on_gpu=0, on_cpu=0, device_skipped=None) -> PytestCounts:
    """A report's counts; `skipped`: reason -> tests, and the device tests among them in `device_skipped`."""
    device = DeviceCounts(on_gpu, on_cpu, Counter(device_skipped or {}))
    return PytestCounts(passed, [f"f{i}" for i in range(failed)], Counter(skipped or {}), device)


NO_CUDA = "graph capture needs a CUDA device"


def a_pytest_step(host_only: bool = False) -> Step:
    return pytest_step("t", "what", ("tests/x.py",), host_only=host_only, timeout_s=10)


def test_tests_that_all_skip_are_skip_no_cuda_on_the_cpu_only_when_each_is_a_device_test():
    device_only = counts(skipped={NO_CUDA: 2}, device_skipped={NO_CUDA: 2})
    assert judge(a_pytest_step(), 0, device_only, "", cuda=False) == (Outcome.SKIP_NO_CUDA, "0 passed, 2 skipped")
    assert judge(a_pytest_step(), 0, device_only, "", cuda=True) == (
        Outcome.FAIL,
        f"every test skipped: {NO_CUDA} (2)",
    )
    host_skipped = counts(skipped={NO_CUDA: 1, "no address but loopback": 1}, device_skipped={NO_CUDA: 1})
    assert judge(a_pytest_step(), 0, host_skipped, "", cuda=False) == (
        Outcome.FAIL,
        f"every test skipped: {NO_CUDA} (1); no address but loopback (1)",
    )


def test_on_a_gpu_run_a_step_none_of_whose_device_tests_ran_on_the_gpu_fails():
    skipped_there = counts(passed=5, skipped={NO_CUDA: 2}, device_skipped={NO_CUDA: 2})
    assert judge(a_pytest_step(), 0, skipped_there, "", cuda=True) == (
        Outcome.FAIL,
        f"no device test ran on the GPU: 0 on the GPU, 2 skipped: {NO_CUDA} (2)",
    )
    on_the_cpu = counts(passed=5, on_cpu=3)
    assert judge(a_pytest_step(), 0, on_the_cpu, "", cuda=True) == (
        Outcome.FAIL,
        "no device test ran on the GPU: 0 on the GPU, 3 on the CPU",
    )
    assert judge(a_pytest_step(), 0, counts(passed=5), "", cuda=True) == (
        Outcome.FAIL,
        "no device test ran on the GPU: 0 on the GPU",
    )
    one_there = counts(passed=5, skipped={NO_CUDA: 2}, on_gpu=1, device_skipped={NO_CUDA: 2})
    assert judge(a_pytest_step(), 0, one_there, "", cuda=True) == (Outcome.PASS, "5 passed, 2 skipped")
    # The host's tests alone, by design (tp's shares); and a rehearsal checks the plumbing, not the GPU.
    assert judge(a_pytest_step(host_only=True), 0, counts(passed=5), "", cuda=True) == (Outcome.PASS, "5 passed")
    assert judge(a_pytest_step(), 0, skipped_there, "", cuda=False) == (Outcome.PASS, "5 passed, 2 skipped")


def test_passing_tests_fail_the_step_when_the_command_fails_as_compute_sanitizer_does():
    report = counts(passed=3, on_gpu=3)
    assert judge(a_pytest_step(), 0, report, "", cuda=True) == (Outcome.PASS, "3 passed")
    outcome, detail = judge(a_pytest_step(), 1, report, "========= ERROR SUMMARY: 1 error", cuda=True)
    assert outcome is Outcome.FAIL and detail.endswith("exit status 1: ========= ERROR SUMMARY: 1 error")
    assert judge(a_pytest_step(), 4, None, "usage: ...", cuda=True) == (
        Outcome.FAIL,
        "exit status 4, no test report: usage: ...",
    )


def test_a_script_skips_only_where_there_is_no_cuda():
    step = script("s", "what", ("x.py",), ("x.py",), timeout_s=10)
    assert judge(step, EXIT_NO_CUDA, None, "needs CUDA\n", cuda=False) == (Outcome.SKIP_NO_CUDA, "needs CUDA")
    assert judge(step, EXIT_NO_CUDA, None, "needs CUDA\n", cuda=True)[0] is Outcome.FAIL
    assert judge(step, 0, None, "", cuda=True) == (Outcome.PASS, "")


def test_figures_are_read_and_judged_and_gpu_only_ones_are_not_missed_on_the_cpu():
    rate = Figure("rate", r"^rate: ([\d,.]+) tok/s", ">= 20000")
    busy = Figure("busy", r"^busy: ([\d.]+)%", cuda_only=True)
    step = script("s", "what", ("x.py",), ("x.py",), timeout_s=10, figures=(rate, busy))
    assert read_figures(step, "rate: 21,500.5 tok/s\n", cuda=False) == ({"rate": "21,500.5"}, [])
    assert read_figures(step, "rate: 21,500.5 tok/s\n", cuda=True) == ({"rate": "21,500.5"}, ["busy"])
    assert rate.verdict("21,500.5") == "met" and rate.verdict("19,999") == "MISSED"
    assert Figure("x", "(.)", "<= 2").verdict("2.5") == "MISSED"


def python_step(name: str, code: str, *, gate: bool = False, timeout_s: int = 30, figures=(), cpu: bool = True) -> Step:
    command = ("{python}", "-c", textwrap.dedent(code))
    return Step(
        name, f"{name} step", Kind.SCRIPT, command, command if cpu else None, timeout_s, gate=gate, figures=figures
    )


def run(tmp_path: Path, stage: Stage, machine: dict = CPU, rehearse: bool = True, only=None) -> tuple[bool, dict]:
    passed = run_stage(stage, Run(rehearse, tmp_path, {"PATH": "/usr/bin:/bin"}, machine), only)
    return passed, json.loads((tmp_path / f"{stage.name}.json").read_text())


def outcomes(report: dict) -> dict[str, str]:
    return {step["name"]: step["outcome"] for step in report["steps"]}


def test_a_failed_gate_ends_the_stage_and_the_files_say_so(tmp_path, capsys):
    stage = Stage(
        "demo",
        "a stage",
        (
            python_step("first", "print('rate: 12.5 tok/s')", figures=(Figure("rate", r"rate: ([\d.]+)"),)),
            python_step("gate", "import sys; print('broken'); sys.exit(3)", gate=True),
            python_step("after", "print('never')"),
            python_step("gpu", "print('never')", cpu=False),
        ),
    )
    passed, report = run(tmp_path, stage)
    assert not passed
    assert outcomes(report) == {"first": "PASS", "gate": "FAIL", "after": "NOT RUN", "gpu": "NOT RUN"}
    assert report["steps"][1]["detail"] == "exit status 3: broken"
    assert report["steps"][0]["figures"] == {"rate": "12.5"}
    table = (tmp_path / "demo.md").read_text()
    assert (
        "| gate | FAIL |" in table
        and "| after | NOT RUN |" in table
        and "stage demo: rehearsal FAIL, nothing run on a GPU (" in table
    )
    assert "REHEARSAL on the CPU" in table and table.strip() in capsys.readouterr().out
    log = (tmp_path / "demo.log").read_text()
    assert "===== first:" in log and "rate: 12.5 tok/s" in log and "never" not in log


def test_a_gpu_only_step_is_skipped_in_a_rehearsal_without_running(tmp_path):
    marker = tmp_path / "ran"
    stage = Stage("demo", "a stage", (python_step("gpu", f"open({str(marker)!r}, 'w')", cpu=False),))
    passed, report = run(tmp_path, stage)
    assert passed and outcomes(report) == {"gpu": "SKIP (no CUDA)"} and not marker.exists()


def test_a_step_needing_more_gpus_than_visible_is_skipped_on_the_gpu_and_rehearsed_on_the_cpu(tmp_path):
    marker = tmp_path / "ran"
    two = Step(
        "pair",
        "two GPUs",
        Kind.SCRIPT,
        ("{python}", "-c", f"open({str(marker)!r}, 'w')"),
        ("{python}", "-c", f"open({str(marker)!r}, 'w')"),
        10,
        gpus=2,
    )
    stage = Stage("demo", "a stage", (python_step("one", "print(1)"), two))
    passed, report = run(tmp_path, stage, machine=GPU, rehearse=False)
    assert passed and outcomes(report) == {"one": "PASS", "pair": "SKIP (too few GPUs)"} and not marker.exists()
    assert report["steps"][1]["detail"] == "needs 2 GPUs, 1 visible"
    assert "on 1 x a stand-in GPU" in (tmp_path / "demo.md").read_text()
    passed, report = run(tmp_path, stage, machine={**GPU, "gpus": 2}, rehearse=False)
    assert passed and outcomes(report) == {"one": "PASS", "pair": "PASS"} and marker.exists()
    marker.unlink()
    passed, report = run(tmp_path, stage)
    assert passed and outcomes(report) == {"one": "PASS", "pair": "PASS"} and marker.exists()


STAND_IN_TESTS = """
    import pytest

    def test_on_the_host():
        pass

    @pytest.mark.cuda
    @pytest.mark.skip(reason="graph capture needs a CUDA device")
    def test_on_the_device():
        pass

    @pytest.mark.cuda(gpus=64)
    def test_on_more_gpus_than_any_host_has():
        pass  # where its module sees too few, on the CPU's stand-in
"""


def test_on_a_gpu_host_a_pytest_step_whose_device_tests_did_not_run_there_fails_and_says_where_they_did(
    tmp_path, monkeypatch
):
    # Issue 40: a step whose CUDA tests all skipped read PASS when its other tests passed.
    monkeypatch.chdir(ROOT)  # where scripts/gpu_acceptance.sh runs the steps: -p finds the plugin there
    tests_file = tmp_path / "stand_in" / "test_stand_in.py"
    tests_file.parent.mkdir()
    tests_file.write_text(textwrap.dedent(STAND_IN_TESTS))
    # The unknown-mark warning an error: the plugin registers `cuda` where no conftest.py does.
    args = ("-W", "error::pytest.PytestUnknownMarkWarning", str(tests_file))
    stage = Stage("demo", "a stage", (pytest_step("graphs", "what", args, timeout_s=120),))
    passed, report = run(tmp_path, stage, machine=GPU, rehearse=False)
    device = "0 on the GPU, 1 on the CPU, 1 skipped: graph capture needs a CUDA device (1)"
    assert not passed and outcomes(report) == {"graphs": "FAIL"}
    assert report["steps"][0]["detail"] == f"no device test ran on the GPU: {device}"
    assert report["steps"][0]["tests"] == {
        "passed": 2,
        "failed": [],
        "skipped": {"graph capture needs a CUDA device": 1},
        "device": {"on_gpu": 0, "on_cpu": 1, "skipped": {"graph capture needs a CUDA device": 1}},
    }
    table = (tmp_path / "demo.md").read_text()
    assert "| graphs | FAIL | " in table and f" | {device} | no device test ran on the GPU: " in table
    assert table.strip().endswith(f"stage demo: FAIL (1 FAIL); log: {tmp_path / 'demo.log'}")


def test_a_rehearsals_report_says_it_ran_nothing_on_a_gpu(tmp_path):
    step = pytest_step("graphs", "what", ("tests/x.py",), timeout_s=10)
    report = StageReport(Stage("demo", "a stage", (step,)), True, CPU, tmp_path)
    report.add(Result(step, Outcome.PASS, "5 passed", tests=counts(passed=5, on_cpu=2)))
    assert "| graphs | PASS | 0 | 0 on the GPU, 2 on the CPU | 5 passed | what |" in report.render()
    assert "no device test runs on a GPU" in report.render()
    assert report.verdict() == "rehearsal PASS, nothing run on a GPU (1 PASS)"


def test_a_step_that_narrows_the_visible_gpus_does_not_widen_a_rehearsals():
    step = python_step("one", "print(1)")
    step = Step(step.name, step.what, step.kind, step.command, step.rehearsal, 10, env={"CUDA_VISIBLE_DEVICES": "0"})
    assert runner.step_env(step, Run(True, Path("."), {"CUDA_VISIBLE_DEVICES": ""}, CPU))["CUDA_VISIBLE_DEVICES"] == ""
    assert runner.step_env(step, Run(False, Path("."), {}, GPU))["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_step_past_its_timeout_is_killed_with_what_it_started(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """
    start = time.monotonic()
    passed, report = run(tmp_path, Stage("demo", "a stage", (python_step("slow", code, timeout_s=2),)))
    assert time.monotonic() - start < 20
    assert outcomes(report) == {"slow": "FAIL"} and report["steps"][0]["detail"] == "timed out after 2 s"
    child = int(pid_file.read_text())
    assert eventually(lambda: not alive(child))


def test_a_runner_stopped_by_sigterm_ends_its_steps_processes_and_says_where_it_stopped(tmp_path):
    # scripts/gpu_session.sh stops a stage at its deadline with timeout(1)'s SIGTERM; the step runs in a
    # session of its own, which the signal does not reach, and would hold the GPU the next stage needs.
    pid_file = tmp_path / "child.pid"
    stage_code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from scripts.acceptance.__main__ import stop_on_sigterm
        from scripts.acceptance.runner import Run, run_stage
        from scripts.acceptance.step import Kind, Stage, Step
        code = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
                "time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(child.pid)); time.sleep(60)")
        command = ("{{python}}", "-c", code)
        stop_on_sigterm()
        run_stage(Stage("demo", "a stage", (Step("slow", "a step", Kind.SCRIPT, command, command, 60),)),
                  Run(True, Path({str(tmp_path)!r}), {{"PATH": "/usr/bin:/bin"}}, {CPU!r}), None)
    """)
    stage = subprocess.Popen([sys.executable, "-c", stage_code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and stage.poll() is None, "the step never started its child"
        time.sleep(0.1)
    stage.send_signal(signal.SIGTERM)
    stdout, _ = stage.communicate(timeout=20)
    assert stage.returncode == 143
    child = int(pid_file.read_text())
    assert eventually(lambda: not alive(child))
    report = json.loads((tmp_path / "demo.json").read_text())
    assert outcomes(report) == {"slow": "FAIL"}
    assert report["steps"][0]["detail"] == "stopped from outside: rerun with --only slow"
    assert "| slow | FAIL |" in stdout


def test_steps_the_stage_has_no_time_left_for_are_not_run(tmp_path):
    stage = Stage("demo", "a stage", (python_step("one", "print(1)"), python_step("two", "print(2)")), budget_s=10)
    passed, report = run(tmp_path, stage)  # less than MIN_STEP_S left from the start
    assert not passed and outcomes(report) == {"one": "NOT RUN", "two": "NOT RUN"}
    assert "rerun with --only" in report["steps"][0]["detail"]


def test_a_step_still_running_at_the_end_of_the_stages_budget_is_stopped_and_says_how_to_rerun(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MIN_STEP_S", 1)
    stage = Stage(
        "demo",
        "a stage",
        (python_step("long", "import time; time.sleep(60)", timeout_s=60), python_step("next", "print(1)")),
        budget_s=3,
    )
    start = time.monotonic()
    passed, report = run(tmp_path, stage)
    assert time.monotonic() - start < 20
    assert outcomes(report) == {"long": "FAIL", "next": "NOT RUN"}
    assert re.fullmatch(
        r"stopped after [23] s, the end of the stage's budget: rerun with --only long", report["steps"][0]["detail"]
    )
    assert report["steps"][1]["detail"] == "out of the stage's 3 s: rerun with --only next"


def test_only_runs_the_named_steps_and_a_missing_figure_fails_a_step(tmp_path):
    stage = Stage(
        "demo",
        "a stage",
        (
            python_step("one", "print('no figure here')", figures=(Figure("rate", r"rate: ([\d.]+)"),)),
            python_step("two", "print(2)"),
        ),
    )
    passed, report = run(tmp_path, stage, machine=GPU, rehearse=False, only={"one"})
    assert not passed and outcomes(report) == {"one": "FAIL"}
    assert report["steps"][0]["detail"] == "not in its output: rate"


def test_every_stage_module_is_registered_and_its_steps_are_well_formed():
    modules = {p.stem for p in (ROOT / "scripts" / "acceptance" / "stages").glob("*.py")} - {"__init__"}
    assert set(ORDER) == modules
    for name, stage in stages().items():
        assert stage.name == name
        names = [step.name for step in stage.steps]
        assert len(set(names)) == len(names), name
        assert sum(step.timeout_s for step in stage.steps) > 0 and stage.budget_s < 600
        assert stage.steps[0].gate, f"{name} should start with the cheap check that could invalidate the rest"


@pytest.mark.parametrize(
    "args, message",
    [
        (["kernels", "OUT", "--only", "nope"], "kernels has no step nope"),
        (["nope", "OUT"], "invalid choice: 'nope'"),
    ],
)
def test_the_command_line_refuses_unknown_stages_and_steps(tmp_path, args, message):
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "scripts.acceptance", *args], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and message in done.stderr
