"""How many flex entries the next read takes (docs/architecture.md, "Between lanes").

A flex entry read is parsed, claimed and started in the iteration that read it, and a default or
priority job that arrives meanwhile waits for the rest of that iteration. Where the engine's step is
long (a GPU's, which the loop waits out in `Engine.step`), that host work hides under it and costs
the waiting job nothing; where the loop is bound by its own host work (a fast engine, or the echo
engine on a CPU), each flex admission lengthens the iteration a higher-lane job waits in
(bench/RESULTS.md, "A flex admission cap that follows the step's length"). So while a higher lane is
being served, a read takes as many flex entries as can be admitted in STEP_MULTIPLE times an engine
step's time as the loop sees it, between FLEX_YIELD_BATCH and FLEX_READ_BATCH; with no higher-lane
job served lately there is nobody to yield to, and it takes FLEX_READ_BATCH. As in vLLM's and SGLang's schedulers,
whose per-step token budget bounds the prefill work a step takes on, the budget here bounds the
loop's admission work per step, by time, since its cost is the host's.

Anti-starvation: FLEX_YIELD_BATCH bounds the yield from below, so the pace never keeps a read from
taking that many flex entries where the worker has room for them; READ's credits (CREDIT_EVERY)
still give flex its share of the entries read while the higher lanes have work waiting."""

from __future__ import annotations

import time
from collections.abc import Callable

from worker.loop.reads import FLEX_READ_BATCH

# The fewest flex entries a read takes while yielding: the fixed cap that shortened a default job's
# wait behind a flex flood on the CPU echo (bench/RESULTS.md, "A lever probed and not kept"); a
# host-bound loop serves the flood slower while it yields (this pace's section there says how much).
FLEX_YIELD_BATCH = 4
# A higher-lane job served this recently marks traffic that sends the next one soon: a steady
# interactive tenant's requests come seconds apart at most.
HIGHER_LANE_RECENT_S = 5.0
# A step as the loop sees it (its wait in Engine.step) is what the host's work of the iteration left
# of the device's step; flex admissions of up to 4 times that take at most 4/5 of the device's step
# and hide under it. Measured on a loaded host, where the loop's other work takes most of a 12 ms
# step now and then: a multiple of 1 cut the flex rate there (bench/RESULTS.md).
STEP_MULTIPLE = 4
# The weight of the latest measure in the moving averages: a step's time moves with the host's
# load and with what the previous iteration left the device to do; one slow step does not swing
# the batch.
SMOOTHING = 0.25


class FlexPace:
    """The moving averages of an engine step's time and of one flex entry's admission (its parse,
    claim and start, the claim's round trip shared out over the entries), both measured on `timer`,
    and when a higher-lane job was last held; from them, `batch()`."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter):
        self.timer = timer
        self.step_s: float | None = None
        self.entry_s: float | None = None
        self.higher_lanes_at = -HIGHER_LANE_RECENT_S

    def stepped(self, seconds: float) -> None:
        """An engine step took `seconds` (its host work and its wait for the device)."""
        self.step_s = smoothed(self.step_s, seconds)

    def admitted(self, entries: int, seconds: float) -> None:
        """`entries` flex entries, and no others, were admitted in `seconds`."""
        if entries > 0:
            self.entry_s = smoothed(self.entry_s, seconds / entries)

    def batch(self, higher_lanes_held: bool) -> int:
        """The most flex entries the next read takes; `higher_lanes_held`: whether a default or
        priority job is held now."""
        now = self.timer()
        if higher_lanes_held:
            self.higher_lanes_at = now
        if now - self.higher_lanes_at > HIGHER_LANE_RECENT_S or self.step_s is None or not self.entry_s:
            return FLEX_READ_BATCH
        fits = int(STEP_MULTIPLE * self.step_s / self.entry_s)
        return max(FLEX_YIELD_BATCH, min(FLEX_READ_BATCH, fits))


def smoothed(average: float | None, latest: float) -> float:
    return latest if average is None else average + SMOOTHING * (latest - average)
