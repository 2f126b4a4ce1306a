"""The adaptive choice of whether a step speculates: per batch size (rounded up to a power of two)
it runs whichever of speculating and not measured more output tokens per second, and tries the
other again after a gap that doubles each time a trial confirms the choice."""

import itertools

from worker.engine.speculative.adaptive import MAX_TRIAL_GAP, MIN_TRIAL_GAP, AdaptiveSpeculation


def run(adaptive: AdaptiveSpeculation, batch: int, steps: int, rate_on, rate_off: float) -> list[bool]:
    """Steps whose outcome is `rate_on` (a figure, or one per step in turn) or `rate_off` tokens per
    second; whether each speculated."""
    rates_on = itertools.cycle(rate_on if isinstance(rate_on, list) else [rate_on])
    choices = []
    for _ in range(steps):
        on = adaptive.speculate(batch)
        adaptive.record(batch, on, int(100 * (next(rates_on) if on else rate_off)), 100.0)
        choices.append(on)
    return choices


def test_a_new_batch_size_measures_both_then_keeps_the_faster():
    adaptive = AdaptiveSpeculation()
    choices = run(adaptive, 4, 2 + MIN_TRIAL_GAP - 1, rate_on=3.0, rate_off=1.0)
    assert choices == [True, False] + [True] * (MIN_TRIAL_GAP - 1)
    assert adaptive.rates(3) == (3.0, 1.0)  # 3 rounds up to 4: the same measurements


def test_when_speculation_loses_it_is_tried_ever_more_rarely():
    adaptive = AdaptiveSpeculation()
    choices = run(adaptive, 256, 2000, rate_on=0.7, rate_off=1.0)
    trials = [i for i, on in enumerate(choices) if on][1:]  # after the first measurement
    gaps = [b - a for a, b in zip(trials, trials[1:])]
    assert gaps[:3] == [2 * MIN_TRIAL_GAP, 4 * MIN_TRIAL_GAP, 8 * MIN_TRIAL_GAP]
    assert max(gaps) == MAX_TRIAL_GAP
    assert sum(choices[1000:]) <= 1000 // MAX_TRIAL_GAP + 1  # at most one step in MAX_TRIAL_GAP speculates


def test_a_change_in_what_pays_is_followed():
    adaptive = AdaptiveSpeculation()
    run(adaptive, 8, 300, rate_on=0.5, rate_off=1.0)  # settled on not speculating
    choices = run(adaptive, 8, 2 * MAX_TRIAL_GAP + 20, rate_on=3.0, rate_off=1.0)  # drafts start matching
    assert all(choices[-10:])


def test_batch_sizes_are_measured_apart():
    adaptive = AdaptiveSpeculation()
    run(adaptive, 1, 50, rate_on=2.0, rate_off=1.0)
    run(adaptive, 200, 50, rate_on=0.9, rate_off=1.0)
    assert adaptive.speculate(1) and not adaptive.speculate(200)


def test_speculating_steps_that_vary_as_acceptance_does_keep_the_choice():
    # 1 to 5 tokens a step at the cost of 1.7 decode steps: 1.76 tokens per decode step's time on average.
    adaptive = AdaptiveSpeculation()
    choices = run(adaptive, 1, 500, rate_on=[t / 1.7 for t in (1, 5, 2, 4, 1, 3, 5, 2, 1, 5)], rate_off=1.0)
    # Its first speculating step took 1 token: off until the first trial, then on but for the trials.
    assert [i for i, on in enumerate(choices) if not on] == [*range(1, MIN_TRIAL_GAP + 1), 17, 33, 65, 129, 257]
