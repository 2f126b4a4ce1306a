"""A queue's throughput over the last minute, from successive readings of how many entries have
left its stream (QueueOverview.processed, a count Redis keeps). The readings are taken when the
board is read, and kept here for a minute: derived from Redis alone, so a gateway that restarts,
or another gateway behind the same address, only starts its window again."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW_S = 60.0


@dataclass(frozen=True)
class Reading:
    at: float  # Redis's clock, epoch seconds
    processed: int


@dataclass(frozen=True)
class Throughput:
    per_minute: float
    over_s: float  # the span it was measured over: a minute, or less until the board has read that long


class ThroughputMeter:
    def __init__(self, window_s: float = WINDOW_S):
        self.window_s = window_s
        self.readings: dict[str, deque[Reading]] = {}

    def observe(self, queue: str, at: float, processed: int | None) -> Throughput | None:
        """Record a reading; the rate since the oldest reading of the window (the last one taken at
        or before its start). None until two readings span some time, and after the count went
        down (the stream was deleted, or Redis lost it): the window starts again."""
        if processed is None:
            self.readings.pop(queue, None)
            return None
        readings = self.readings.setdefault(queue, deque())
        if readings and (processed < readings[-1].processed or at < readings[-1].at):
            readings.clear()
        readings.append(Reading(at, processed))
        while len(readings) > 2 and readings[1].at <= at - self.window_s:
            readings.popleft()
        first = readings[0]
        if at <= first.at:
            return None
        return Throughput(per_minute=(processed - first.processed) * 60.0 / (at - first.at), over_s=at - first.at)

    def forget_others(self, queues: set[str]) -> None:
        """Drop the readings of queues the board no longer shows."""
        for queue in set(self.readings) - queues:
            del self.readings[queue]
