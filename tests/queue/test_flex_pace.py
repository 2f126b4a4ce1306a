"""How many flex entries a read takes (worker/loop/flex_pace.py), on given step and admission times:
as many as can be admitted in STEP_MULTIPLE engine steps' time while a higher lane is served,
between FLEX_YIELD_BATCH and FLEX_READ_BATCH, and FLEX_READ_BATCH with no higher lane to yield to.

Times are multiples of 1/1024 s, exact in binary."""

from worker.loop.flex_pace import FLEX_YIELD_BATCH, HIGHER_LANE_RECENT_S, STEP_MULTIPLE, FlexPace
from worker.loop.reads import FLEX_READ_BATCH

MS = 1 / 1024


class Timer:
    def __init__(self) -> None:
        self.now = 100.0  # a monotonic clock's time: far from 0

    def __call__(self) -> float:
        return self.now


def measured(step_s: float, entry_s: float, timer: Timer | None = None) -> FlexPace:
    pace = FlexPace(timer or Timer())
    pace.stepped(step_s)
    pace.admitted(16, 16 * entry_s)
    return pace


def test_flex_takes_the_whole_batch_before_anything_is_measured():
    pace = FlexPace(Timer())
    assert pace.batch(higher_lanes_held=True) == FLEX_READ_BATCH
    pace.stepped(0.0)
    assert pace.batch(higher_lanes_held=True) == FLEX_READ_BATCH  # no admission measured yet


def test_a_long_step_hides_the_flex_admissions_so_flex_takes_the_whole_batch():
    """A GPU's step (12 ms) against 16 admissions of 0.125 ms each: they fit many times over."""
    assert measured(12 * MS, MS / 8).batch(higher_lanes_held=True) == FLEX_READ_BATCH


def test_a_host_bound_loop_yields_to_the_higher_lanes_down_to_the_yield_batch():
    """The echo's step on a CPU (1/16 ms) against admissions of 1/8 ms: 2 fit, the floor holds."""
    assert measured(MS / 16, MS / 8).batch(higher_lanes_held=True) == FLEX_YIELD_BATCH


def test_between_the_bounds_flex_takes_what_fits_in_a_step():
    assert STEP_MULTIPLE == 4
    assert measured(2 * MS, MS).batch(higher_lanes_held=True) == 8
    assert measured(3.5 * MS, MS).batch(higher_lanes_held=True) == 14


def test_with_no_higher_lane_served_lately_flex_takes_the_whole_batch():
    """Nobody to yield to: a flex flood alone on a host-bound loop keeps whole reads."""
    timer = Timer()
    pace = measured(MS / 16, MS / 8, timer)
    assert pace.batch(higher_lanes_held=False) == FLEX_READ_BATCH
    assert pace.batch(higher_lanes_held=True) == FLEX_YIELD_BATCH
    timer.now += HIGHER_LANE_RECENT_S
    assert pace.batch(higher_lanes_held=False) == FLEX_YIELD_BATCH  # served that recently: still yields
    timer.now += MS
    assert pace.batch(higher_lanes_held=False) == FLEX_READ_BATCH


def test_one_slow_step_does_not_swing_the_batch():
    """A step 4x the usual once (the host's load) moves the step's average by 3/4 of the usual."""
    pace = measured(2 * MS, MS)
    pace.stepped(8 * MS)
    assert pace.step_s == 3.5 * MS
    assert pace.batch(higher_lanes_held=True) == 14


def test_an_admission_of_no_entries_changes_nothing():
    pace = measured(8 * MS, MS)
    pace.admitted(0, 5 * MS)
    assert pace.entry_s == MS
