"""A pytest plugin for test_schedule_totals.py: it stands in for the fault schedules (each returns
what a schedule that placed, stole, reclaimed, used the lanes and ran over shards would count) so
that the module's totals check can be run over a hundred schedules in a few seconds.
MILI_LOSE_SCHEDULE names a seed that is skipped as if lost."""

from __future__ import annotations

import os

import pytest

import harness.chaos_schedules


def counted_schedule(seed, redis):
    if str(seed) == os.environ.get("MILI_LOSE_SCHEDULE"):
        pytest.skip("this schedule is lost on purpose")
    return {"placed": 1, "stolen": 1, "reclaimed": 1, "laned": 1, "sharded": 1}


harness.chaos_schedules.run_schedule = counted_schedule
