"""Device work on the timeline of a torch.profiler Chrome trace: the share of the profiled engine
steps' span the device was busy, and the idle gaps between its work (bench/decode_step.py --trace)."""

from __future__ import annotations

from dataclasses import dataclass

STEP_RANGE = "engine_step"  # the record_function range around each profiled step
DEVICE_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}  # Kineto's categories of device work


@dataclass(frozen=True)
class Timeline:
    """Microseconds on the trace's clock. The span runs from the first step's start to the end of
    the last device work launched before the last step ended: overlapped, a step's device work
    outlasts the host's part of it."""

    steps: list[tuple[float, float]]  # (start, end) of each engine step on the host
    device: list[tuple[float, float]]  # device work within the span, merged and sorted
    span: tuple[float, float]

    @classmethod
    def from_trace(cls, events: list[dict]) -> Timeline:
        steps = sorted(
            (e["ts"], e["ts"] + e["dur"])
            for e in events
            if e.get("name") == STEP_RANGE and e.get("cat") == "user_annotation"
        )
        if not steps:
            raise ValueError(f"the trace holds no {STEP_RANGE} range")
        start, host_end = steps[0][0], steps[-1][1]
        work = [
            (max(e["ts"], start), e["ts"] + e["dur"])
            for e in events
            if e.get("cat") in DEVICE_CATEGORIES and e["ts"] < host_end and e["ts"] + e["dur"] > start
        ]
        end = max([host_end] + [b for _, b in work])
        return cls(steps, merged(sorted(work)), (start, end))

    @property
    def span_us(self) -> float:
        return self.span[1] - self.span[0]

    def busy_share(self) -> float:
        return sum(b - a for a, b in self.device) / self.span_us

    def gaps_us(self) -> list[float]:
        """Idle time between consecutive stretches of device work."""
        return [b[0] - a[1] for a, b in zip(self.device, self.device[1:])]


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in intervals:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
