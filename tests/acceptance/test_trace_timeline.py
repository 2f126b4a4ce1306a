"""bench/trace_timeline.py: the GPU-busy share and the idle gaps that the bench stage's profile
reports, read from a Chrome trace as torch.profiler writes it."""

import pytest

from bench.trace_timeline import Timeline


def event(cat: str, ts: float, dur: float, name: str = "k") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_share_and_gaps_come_from_the_device_work_of_the_profiled_steps():
    events = [
        event("user_annotation", 0, 100, "engine_step"),
        event("user_annotation", 100, 80, "engine_step"),
        event("cpu_op", 0, 180, "aten::mm"),  # host work is not device work
        event("kernel", -50, 60),  # launched before the steps: only its part inside counts
        event("kernel", 30, 30),
        event("kernel", 50, 20),  # overlapping: counted once
        event("gpu_memcpy", 120, 30),
        event("gpu_memset", 150, 10),
        event("kernel", 170, 30),  # launched in the last step, ends after it: the span runs to its end
        event("kernel", 400, 10),  # after the steps: not theirs
        {"ph": "f", "cat": "ac2g", "name": "flow", "ts": 5},  # events without a duration are ignored
    ]
    timeline = Timeline.from_trace(events)
    assert timeline.span == (0, 200)
    assert timeline.device == [(0, 10), (30, 70), (120, 160), (170, 200)]
    assert timeline.busy_share() == pytest.approx((10 + 40 + 40 + 30) / 200)
    assert timeline.gaps_us() == [20, 50, 10]


def test_a_trace_without_the_step_ranges_is_refused():
    with pytest.raises(ValueError, match="no engine_step range"):
        Timeline.from_trace([event("kernel", 0, 10)])
