"""100 random fault schedules against the protocol (see tests/chaos/schedules.py for what they
do and the invariants checked after each), with cache-aware placement on: jobs are placed on
workers that are then killed, stalled, drained or restarted under. A failure names its seed;
`python -m bench.chaos --seed N --schedules 1` runs that schedule again, and
`python -m bench.chaos --schedules 1000` runs more."""
from __future__ import annotations

import pytest

from tests.chaos.schedules import run_schedule
from tests.support.redis_servers import RestartableRedis

SCHEDULES = 100
# One xdist process runs the whole module, in order: the last test reads what every schedule added
# up in this process's TOTALS (and the schedules share one Redis).
pytestmark = pytest.mark.xdist_group("chaos-schedules")


@pytest.fixture(scope="module")
def chaos_redis(tmp_path_factory):
    server = RestartableRedis(tmp_path_factory.mktemp("chaos-redis")).start()
    yield server
    server.stop()


# What the schedules of this module did, added up: the last test checks that they covered placement.
TOTALS = {"schedules": 0, "placed": 0, "stolen": 0, "reclaimed": 0}


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_a_random_fault_schedule_keeps_every_invariant(chaos_redis, seed):
    counts = run_schedule(seed, chaos_redis)
    TOTALS["schedules"] += 1
    for name in ("placed", "stolen", "reclaimed"):
        TOTALS[name] += counts[name]


@pytest.mark.slow
def test_the_schedules_placed_jobs_on_workers_that_then_failed():
    """Run after the schedules (pytest keeps a module's order): jobs were placed on workers' own
    streams, and some were stolen from, and reclaimed out of, those of troubled workers."""
    assert TOTALS["schedules"] == SCHEDULES, "run the whole module: the totals add up every schedule"
    assert TOTALS["placed"] > 0 and TOTALS["stolen"] > 0 and TOTALS["reclaimed"] > 0, TOTALS
