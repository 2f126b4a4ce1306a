"""The operator's `mili` commands in process, on a real redis-server: what they print, and that every
bad input is one line on stderr with a non-zero exit that changes nothing."""

from __future__ import annotations

import json
import time

import pytest

from cli.__main__ import main
from producer_client import Client
from producer_client.keys import PROTOCOL_VERSION, Keys
from tests.queue.test_dead_letters import make_poison, take

KEYS = Keys()


@pytest.fixture
def mili(redis_server, queue, capsys):
    def run(*args: str) -> tuple[int, str, str]:
        try:
            code = main(["--redis", redis_server.url, "--queue", queue, *args])
        except SystemExit as e:  # a usage error, from argparse
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_jobs_lists_the_queued_and_running_jobs(mili, redis_server, redis_client, queue):
    with Client(redis_server.url, queue) as client:
        jobs = [client.submit(f"job {i}", max_tokens=4) for i in range(3)]
    entry, _ = take(redis_client, queue, "w1")
    code, out, _ = mili("jobs", "--status", "queued")
    assert code == 0 and [line.split()[0] for line in out.splitlines()] == ["JOB", jobs[1], jobs[2]]
    code, out, _ = mili("jobs", "--status", "running", "--limit", "5")
    assert code == 0 and out.splitlines()[1].split()[:4] == [jobs[0], entry, "w1", "1"]


def test_jobs_lists_the_jobs_of_lanes_and_of_workers_streams_with_their_route(mili, redis_server, redis_client, queue):
    with Client(redis_server.url, queue, tenant="ta") as client:
        flex = client.submit("flex", max_tokens=4, service_tier="flex")
    redis_client.zadd(KEYS.workers(queue), {"w1": time.time()})
    placed = {
        "id": "placed-1",
        "v": str(PROTOCOL_VERSION),
        "body": "{}",
        "cost": "9",
        "lane": "priority",
        "tenant": "tb",
    }
    redis_client.xadd(KEYS.own_queue(queue, "w1"), placed)
    code, out, _ = mili("jobs", "--status", "queued")
    rows = [line.split() for line in out.splitlines()]
    assert code == 0 and rows[0] == ["JOB", "ENTRY", "WAITING", "LANE", "TENANT", "PLACED", "ON"]
    assert [row[:1] + row[3:] for row in rows[1:]] == [[flex, "flex", "ta", "-"], ["placed-1", "priority", "tb", "w1"]]


def test_dead_purge_older_than_takes_a_duration(mili, redis_server, redis_client, queue):
    with Client(redis_server.url, queue) as client:
        make_poison(redis_client, queue, client.submit("poison", max_tokens=4))
    assert mili("dead", "purge", "--older-than", "1h")[:2] == (0, "purged 0 dead letters\n")
    assert redis_client.xlen(KEYS.dead(queue)) == 1
    assert mili("dead", "purge", "--all")[:2] == (0, "purged 1 dead letters\n")


@pytest.mark.parametrize(
    "args, code, message",
    [
        (
            ("jobs", "--status", "failed"),
            1,
            "error: invalid_argument: status: failed jobs cannot be listed: ended jobs have no index",
        ),
        (("jobs", "--status", "sleeping"), 1, "error: invalid_argument: status: must be one of queued, running, dead"),
        (("jobs",), 2, "error: invalid_argument: the following arguments are required: --status"),
        (
            ("jobs", "--status", "queued", "--limit", "0"),
            1,
            "error: invalid_argument: limit: must be an integer from 1 to 10000",
        ),
        (
            ("dead", "list", "--limit", "many"),
            2,
            "error: invalid_argument: argument --limit: invalid int value: 'many'",
        ),
        (("dead", "retry"), 1, "error: invalid_argument: id: give exactly one of ID or --all"),
        (("dead", "retry", "x", "--all"), 1, "error: invalid_argument: id: give exactly one of ID or --all"),
        (
            ("dead", "purge", "--all", "--older-than", "1d"),
            1,
            "error: invalid_argument: id: give exactly one of ID or --all or --older-than",
        ),
        (("dead", "purge", "--older-than", "soon"), 1, "error: invalid_argument: older_than: 'soon' is not a duration"),
        (("dead", "purge", "--older-than", "0s"), 1, "error: invalid_argument: older_than: '0s' is not a duration"),
        (
            ("dead", "purge", "--older-than", "-1d"),
            1,
            "error: invalid_argument: older_than: '-1d' is not a duration: it must be positive",
        ),
        (
            ("dead", "purge", "--older-than=-1d"),
            1,
            "error: invalid_argument: older_than: '-1d' is not a duration: it must be positive",
        ),
        (("dead", "purge", "--older-than", "--all"), 2, "error: invalid_argument: argument --older-than: expected one"),
        (("dead", "show", "no-such-job"), 1, "error: not_found: queue"),
        (("dead", "retry", "{bad}"), 1, "error: invalid_argument: id: must be 1-128 characters"),
        (("dead", "frobnicate"), 2, "error: invalid_argument: argument dead_command: invalid choice: 'frobnicate'"),
    ],
)
def test_a_bad_input_is_one_line_and_changes_nothing(mili, redis_server, redis_client, queue, args, code, message):
    with Client(redis_server.url, queue) as client:
        make_poison(redis_client, queue, client.submit("poison", max_tokens=4))
    got_code, _, err = mili(*args)
    assert got_code == code
    assert err.count("\n") == 1 and err.startswith(message), err
    assert redis_client.xlen(KEYS.dead(queue)) == 1


def test_quota_set_and_show_print_the_tenants_settings_and_a_limit_of_0_is_refused(mili, redis_client):
    tenant = f"team-{redis_client.incr('test:quota-tenant')}"
    code, out, _ = mili("quota", "set", tenant, "--max-waiting", "100", "--rpm", "60", "--weight", "2")
    assert code == 0 and out.splitlines()[0].split() == ["TENANT", "MAX", "WAITING", "RPM", "TPM", "WEIGHT"]
    assert out.splitlines()[1].split() == [tenant, "100", "60", "unlimited", "2"]
    assert mili("quota", "set", tenant, "--unset", "rpm", "--tpm", "5000")[0] == 0
    code, out, _ = mili("quota", "show", tenant)
    assert out.splitlines()[1].split() == [tenant, "100", "unlimited", "5000", "2"]
    assert tenant in mili("quota", "show")[1]
    code, out, err = mili("quota", "set", tenant, "--rpm", "0")
    assert (code, out) == (1, "") and err.startswith("error: invalid_argument: rpm: must be a whole number from 1")
    code, _, err = mili("quota", "set", "bad:name", "--rpm", "1")
    assert code == 1 and err.startswith("error: invalid_argument: tenant:")
    assert redis_client.hget(KEYS.quota(tenant), "rpm") is None


def test_a_quota_setting_both_set_and_unset_is_refused_and_changes_nothing(mili, redis_client):
    """`--rpm 60 --unset rpm` asks for two things: the removal won, silently; now neither is done."""
    tenant = f"team-{redis_client.incr('test:quota-tenant')}"
    assert mili("quota", "set", tenant, "--rpm", "30")[0] == 0
    code, out, err = mili("quota", "set", tenant, "--rpm", "60", "--tpm", "100", "--unset", "rpm")
    assert (code, out, err) == (
        1,
        "",
        "error: invalid_argument: unset: rpm is both set and unset: give one of the two\n",
    )
    assert redis_client.hgetall(KEYS.quota(tenant)) == {"rpm": "30"}


def test_quota_set_and_show_print_large_limits_and_fine_weights_exactly(mili, redis_client):
    """A limit of a million printed `1e+06`, a TPM of 123456789 `1.23457e+08` (what the operator
    read was not what held), and a weight of 123.4567 `123.457`: each is printed as set."""
    tenant = f"team-{redis_client.incr('test:quota-tenant')}"
    args = ("--max-waiting", "1000000000", "--rpm", "1000000", "--tpm", "123456789", "--weight", "123.4567")
    code, out, _ = mili("quota", "set", tenant, *args)
    assert code == 0 and out.splitlines()[1].split() == [tenant, "1000000000", "1000000", "123456789", "123.4567"]
    assert mili("quota", "show", tenant)[1] == out


def test_quota_show_of_a_tenant_with_no_settings_prints_the_defaults_that_hold(mili, redis_client):
    # On main: a row of dashes, which said nothing of what holds.
    tenant = f"team-{redis_client.incr('test:quota-tenant')}"
    code, out, err = mili("quota", "show", tenant)
    assert code == 0 and out.splitlines()[1].split() == [tenant, "unlimited", "unlimited", "unlimited", "1"]
    assert err == f"({tenant} has no settings: no limits, weight 1)\n"
    mili("quota", "set", tenant, "--rpm", "60")
    code, out, err = mili("quota", "set", tenant, "--unset", "rpm")
    assert out.splitlines()[1].split() == [tenant, "unlimited", "unlimited", "unlimited", "1"] and "no settings" in err


def test_quota_show_reads_an_index_of_another_type_as_no_quotas_set(mili, redis_client, queue):
    """`mili quota show` printed Redis's raw `ResponseError: WRONGTYPE` when the tenants' index
    (mili:quotas, which `quota set` writes) held another type; a tenant's settings hash of another
    type read as none already (tenants.settings_hash), as the sharing reads read such keys
    (connection.unless_other_type). Under a prefix of its own: other tests share the index."""
    prefix = f"other-{queue}"
    keys = Keys(prefix)
    redis_client.set(keys.quotas(), "not a sorted set")
    redis_client.set(keys.quota("team-x"), "not a hash")
    none_set = mili("--prefix", f"empty-{queue}", "quota", "show")
    assert none_set == (0, "TENANT  MAX WAITING  RPM  TPM  WEIGHT\n", "(none)\n")
    assert mili("--prefix", prefix, "quota", "show") == none_set
    code, out, err = mili("--prefix", prefix, "quota", "show", "team-x")
    assert code == 0 and out.splitlines()[1].split() == ["team-x", "unlimited", "unlimited", "unlimited", "1"]


def test_quota_set_refuses_a_quota_key_of_another_type_and_writes_nothing(mili, redis_client, queue):
    """`mili quota set` printed Redis's raw `ResponseError: WRONGTYPE` when the tenants' index
    (mili:quotas) or the tenant's settings hash held another type, and had written the settings
    before the index's ZADD failed. Now: one line naming the key, exit 1, nothing written. Under a
    prefix of its own: other tests share the index."""
    keys = Keys(f"other-{queue}")
    redis_client.set(keys.quotas(), "not a sorted set")
    code, out, err = mili("--prefix", f"other-{queue}", "quota", "set", "team-x", "--rpm", "60")
    assert (code, out) == (1, "")
    assert err == (
        f"error: invalid_quota_key: {keys.quotas()} holds a string, not the sorted set MILI writes there: "
        "mili quota set writes nothing until an operator deletes it\n"
    )
    assert redis_client.exists(keys.quota("team-x")) == 0
    redis_client.delete(keys.quotas())
    redis_client.rpush(keys.quota("team-y"), "not a hash")
    code, out, err = mili("--prefix", f"other-{queue}", "quota", "set", "team-y", "--rpm", "60")
    assert (code, out) == (1, "")
    assert err == (
        f"error: invalid_quota_key: {keys.quota('team-y')} holds a list, not the hash MILI writes there: "
        "mili quota set writes nothing until an operator deletes it\n"
    )
    assert redis_client.exists(keys.quotas()) == 0 and redis_client.lrange(keys.quota("team-y"), 0, -1) == [
        "not a hash"
    ]


def test_quota_show_names_a_tenant_whose_settings_key_holds_another_type(mili, redis_client, queue):
    """A tenant's settings key made another type reads as no settings, so the tenant runs without
    limits: `mili quota show` left the tenant out, and `mili quota show TENANT` said it had no
    settings. Now both show it as it holds and name its key on stderr; the other tenants are shown
    as before. Under a prefix of its own: other tests share the index."""
    prefix = f"typed-{queue}"
    keys = Keys(prefix)
    for tenant in ("team-good", "team-bad"):
        assert mili("--prefix", prefix, "quota", "set", tenant, "--rpm", "60")[0] == 0
    redis_client.delete(keys.quota("team-bad"))
    redis_client.set(keys.quota("team-bad"), "an operator's mistake")
    named = (
        f"(team-bad: {keys.quota('team-bad')} holds another type than the hash MILI writes there: read as no "
        "settings, no limits, until an operator deletes it)\n"
    )
    code, out, err = mili("--prefix", prefix, "quota", "show")
    assert (code, err) == (0, named), err
    assert [line.split() for line in out.splitlines()[1:]] == [
        ["team-bad", "unlimited", "unlimited", "unlimited", "1"],
        ["team-good", "unlimited", "60", "unlimited", "1"],
    ]
    code, out, err = mili("--prefix", prefix, "quota", "show", "team-bad")
    assert (code, err) == (0, named), err
    assert out.splitlines()[1].split() == ["team-bad", "unlimited", "unlimited", "unlimited", "1"]
    code, _, err = mili("--prefix", prefix, "quota", "show", "team-good")
    assert (code, err) == (0, "")


def test_submit_takes_a_service_tier_and_the_tenant(mili, redis_client, queue):
    code, out, _ = mili("--tenant", "team-cli", "submit", "hi", "--service-tier", "flex", "--max-tokens", "1")
    assert code == 0
    [(_, fields)] = redis_client.xrange(KEYS.lane_stream(queue, "flex", "team-cli"))
    assert fields["id"] == out.strip()
    code, _, err = mili("submit", "hi", "--service-tier", "gold")
    assert code == 2 and "invalid choice: 'gold'" in err


def test_a_value_that_begins_with_a_dash_is_the_flags_value(mili, redis_client, queue):
    """`--stop -END` and `--regex -?[0-9]+` were argparse's "expected one argument" (a token that
    begins with '-' is taken for a flag): a value after its flag is the flag's, unless it is one of
    mili's flags."""
    assert mili("submit", "hi", "--max-tokens", "1", "--stop", "-END")[0] == 0
    assert mili("submit", "hi", "--max-tokens", "1", "--regex", "-?[0-9]+")[0] == 0
    stop, regex = (json.loads(fields["body"]) for _, fields in redis_client.xrange(KEYS.queue(queue)))
    assert (stop["params"]["stop"], regex["params"]["response_format"]["pattern"]) == (["-END"], "-?[0-9]+")
