"""100 random fault schedules against the protocol (see tests/chaos/schedules.py for what they
do and the invariants checked after each). A failure names its seed; `python -m bench.chaos
--seed N --schedules 1` runs that schedule again, and `python -m bench.chaos --schedules 1000` runs more."""
from __future__ import annotations

import pytest

from tests.chaos.schedules import run_schedule
from tests.support.redis_servers import RestartableRedis

SCHEDULES = 100


@pytest.fixture(scope="module")
def chaos_redis(tmp_path_factory):
    server = RestartableRedis(tmp_path_factory.mktemp("chaos-redis")).start()
    yield server
    server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SCHEDULES))
def test_a_random_fault_schedule_keeps_every_invariant(chaos_redis, seed):
    run_schedule(seed, chaos_redis)
