"""The schedules' check that every job key expires (harness/chaos_schedules.py) reads a key in the
last moments of its life as expiring, not as staying."""

from __future__ import annotations

import random
import uuid

import pytest

from harness.chaos_schedules import SETTINGS, Run, ScheduleFailed, check_keys_expire
from producer_client.keys import Keys


@pytest.fixture
def keys(redis_client):
    """A prefix of the test's own on the session's server, its keys deleted after."""
    keys = Keys(f"chk{uuid.uuid4().hex[:8]}")
    yield keys
    for key in redis_client.scan_iter(match=f"{keys.prefix}:*"):
        redis_client.delete(key)


def check(redis_server, admin, keys: Keys) -> None:
    check_keys_expire(Run(seed=0, url=redis_server.url, prefix=keys.prefix, rng=random.Random(0)), admin, keys)


def test_a_done_stream_in_its_last_half_second_counts_as_expiring(redis_server, redis_client, keys):
    """TTL rounds to whole seconds: a done stream with under 500 ms of its DONE_TTL_MS left read
    TTL 0 and failed the check as a key that never expires would (seed 6279 of bench.chaos)."""
    redis_client.xadd(keys.done("j1"), {"result": "{}"})
    redis_client.pexpire(keys.done("j1"), 300)
    assert redis_client.ttl(keys.done("j1")) == 0  # what the check read
    check(redis_server, redis_client, keys)


@pytest.mark.parametrize("ttl_s", [None, SETTINGS["result_ttl_s"] + 60])
def test_a_job_key_without_its_ttl_or_past_result_ttl_s_fails_the_check(redis_server, redis_client, keys, ttl_s):
    redis_client.hset(keys.job("j2"), "status", "done")
    if ttl_s is not None:
        redis_client.expire(keys.job("j2"), ttl_s)
    with pytest.raises(ScheduleFailed, match="stays: PTTL"):
        check(redis_server, redis_client, keys)
