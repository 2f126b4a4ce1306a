"""100 random fault schedules against the protocol (see harness/chaos_schedules.py for what they
do and the invariants checked after each), with cache-aware placement on: jobs are placed on
workers that are then killed, stalled, drained or restarted under. A failure names its seed;
`python -m bench.chaos --seed N --schedules 1` runs that schedule again, and
`python -m bench.chaos --schedules 1000` runs more."""

from __future__ import annotations

import pytest

from harness.chaos_schedules import run_schedule
from harness.redis_servers import RestartableRedis

SCHEDULES = 100
# One xdist process runs every schedule (they share one Redis), so that its TOTALS see them all.
pytestmark = [pytest.mark.xdist_group("chaos-schedules"), pytest.mark.waits]


# What the schedules of this module did, added up: test_the_schedules_covered_placement checks, once
# they have all run, that they covered placement.
TOTALS = {"schedules": 0, "placed": 0, "stolen": 0, "reclaimed": 0, "laned": 0, "sharded": 0}
COVERED = ("placed", "stolen", "reclaimed", "laned", "sharded")


@pytest.fixture(scope="module")
def chaos_redis(tmp_path_factory):
    server = RestartableRedis(tmp_path_factory.mktemp("chaos-redis")).start()
    yield server
    server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_a_random_fault_schedule_keeps_every_invariant(chaos_redis, seed):
    counts = run_schedule(seed, chaos_redis)
    TOTALS["schedules"] += 1
    for name in COVERED:
        TOTALS[name] += counts[name]


def scheduled_in(session: pytest.Session) -> int:
    return sum(1 for item in session.items if item.originalname == "test_a_random_fault_schedule_keeps_every_invariant")


@pytest.mark.slow
def test_the_schedules_covered_placement(request):
    """After the schedules (pytest runs a module's tests in order, and its xdist group keeps them on
    one process): every schedule selected has run to its end, and when they were all selected (a full
    run, not a -k choice of a few), jobs were placed on workers' own streams, and some were stolen from,
    and reclaimed out of, those of troubled workers, jobs went through the lanes, and queues ran over
    several shards. A schedule that failed or never ran fails this too,
    so a full run cannot pass without the coverage check."""
    # xdist appends a test's group to its node id under --dist loadgroup alone: under -n 2's default
    # (load) the schedules are shared out, and each process's TOTALS count its share only. (An xdist
    # process's config has its workerinput; its environment passes on to a pytest it starts.)
    if hasattr(request.config, "workerinput") and "@chaos-schedules" not in request.node.nodeid:
        pytest.fail(
            "the schedules ran on several xdist processes: run them with --dist loadgroup (scripts/test.sh does)"
        )
    selected = scheduled_in(request.session)
    assert TOTALS["schedules"] == selected, f"{TOTALS['schedules']} of the {selected} selected schedules ran"
    if selected == SCHEDULES:
        assert all(TOTALS[name] > 0 for name in COVERED), TOTALS
