"""When speculation pays: measured, per batch size.

A verify step costs more than a decode step (k more tokens per request through the model, the
proposer's work, a step the overlap scheduler cannot hide), and pays back in accepted tokens. How
the two compare depends on the device, the model, the batch (a large batch fills the device, so
extra tokens stop being nearly free) and how often drafts are right, so the engine measures it:
for each batch size, rounded to a power of two, it keeps the output tokens per second of the
decode steps that speculated and of those that did not (exponential averages), and each step runs
the better one, switching only when the other is better by more than HYSTERESIS (a speculating
step's tokens vary from 1 to k + 1, and noise must not flip the choice). The other is tried again
now and then, to follow a change (drafts that start or stop matching, contexts that grow), its
stale figure replaced by the trial's; each time a trial confirms the choice the next one comes
twice as late, up to MAX_TRIAL_GAP steps, so a settled choice costs at most 1/MAX_TRIAL_GAP of a
step of the other kind per step. A batch size not yet measured tries both.
"""

from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.1  # weight of a step's own tokens per second in its average
HYSTERESIS = 0.05
MIN_TRIAL_GAP, MAX_TRIAL_GAP = 8, 256


@dataclass
class Arm:
    rate: float | None = None  # output tokens per second
    steps: int = 0  # measured steps

    def update(self, rate: float) -> None:
        """Folds a step's rate into the average; an arm without one takes it whole."""
        self.rate = rate if self.rate is None else (1 - SMOOTHING) * self.rate + SMOOTHING * rate
        self.steps += 1


@dataclass
class Bucket:
    on: Arm
    off: Arm
    choice: bool = True  # speculate
    gap: int = MIN_TRIAL_GAP  # steps between trials of the arm not chosen
    since_trial: int = 0
    trying: bool = False  # the step in flight is a trial

    @property
    def measured(self) -> bool:
        return self.on.rate is not None and self.off.rate is not None

    def rechoose(self) -> None:
        chosen, other = (self.on, self.off) if self.choice else (self.off, self.on)
        if other.rate > chosen.rate * (1 + HYSTERESIS):
            self.choice = not self.choice


class AdaptiveSpeculation:
    def __init__(self):
        self._buckets: dict[int, Bucket] = {}

    def speculate(self, batch: int) -> bool:
        """Whether a step of `batch` decoding requests should speculate."""
        bucket = self._bucket(batch)
        if not bucket.measured:
            bucket.trying = False
            return bucket.on.rate is None  # measure speculation first, then without
        bucket.since_trial += 1
        bucket.trying = bucket.since_trial >= bucket.gap
        return bucket.choice != bucket.trying

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode step's outcome: `tokens` output tokens in `seconds`."""
        if seconds <= 0:
            return
        bucket = self._bucket(batch)
        choice_before = bucket.choice
        arm = bucket.on if speculated else bucket.off
        if bucket.trying:
            arm.rate = None  # measured a gap ago: stale, the trial's figure replaces it
        arm.update(tokens / seconds)
        if not bucket.measured:
            return
        bucket.rechoose()
        if bucket.trying:
            bucket.trying, bucket.since_trial = False, 0
            confirmed = bucket.choice == choice_before
            bucket.gap = min(2 * bucket.gap, MAX_TRIAL_GAP) if confirmed else MIN_TRIAL_GAP

    def rates(self, batch: int) -> tuple[float | None, float | None]:
        """(with, without) speculation: the tokens per second measured for this batch size."""
        bucket = self._bucket(batch)
        return bucket.on.rate, bucket.off.rate

    def _bucket(self, batch: int) -> Bucket:
        key = 1 << max(0, batch - 1).bit_length()  # the power of two at or above it
        if key not in self._buckets:
            self._buckets[key] = Bucket(Arm(), Arm())
        return self._buckets[key]
