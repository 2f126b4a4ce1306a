"""bench/peers.py's accounting: Redis time charged to the command or script that spent it, per
job, and the verdicts of its target rows."""

import pytest

from bench.peer_queues import report
from bench.peer_queues.redis_costs import RedisCosts, script_costs, slowlog_everything

SCRIPT = "redis.call('SET', KEYS[1], ARGV[1]); redis.call('TYPE', KEYS[1]); redis.call('TYPE', KEYS[1]); return 1"


def test_a_scripts_commands_are_charged_to_the_script_that_ran_them(redis_client):
    sha = redis_client.script_load(SCRIPT)
    before = redis_client.config_get("slowlog-*")
    with slowlog_everything(redis_client):
        for i in range(2):
            redis_client.evalsha(sha, 1, f"peers-bench:{i}", "x")
        redis_client.hset("peers-bench:h", "f", "v")
        entries = redis_client.slowlog_get(-1)
    assert redis_client.config_get("slowlog-*") == before

    costs = script_costs(entries, jobs=2)
    name = f"evalsha {sha[:10]}"  # not a script of the protocol: named by its sha
    assert {cmd: calls for cmd, (calls, _) in costs["per_job"].items()} == {name: 1.0, "hset": 0.5}
    assert {cmd: calls for cmd, (calls, _) in costs["inside"][name].items()} == {"set": 1.0, "type": 2.0}
    assert costs["complete"]


def test_commands_per_job_count_only_what_ran_between_the_readings():
    before = {"evalsha": (10, 100), "xadd": (4, 8), "info": (3, 9)}
    after = {"evalsha": (16, 400), "xadd": (4, 8), "info": (5, 20), "xread": (3, 30)}
    assert RedisCosts.per_job(before, after, jobs=3) == {"evalsha": (2.0, 100.0), "xread": (1.0, 10.0)}


def figures(jobs_per_s, added_p50_ms, redis_cpu_us=100.0, submit_cpu_us=150.0, memory_per_job=300.0):
    return {c.key: 1.0 for c in report.COLUMNS} | {
        "jobs_per_s": jobs_per_s,
        "added_p50_ms": added_p50_ms,
        "redis_cpu_us": redis_cpu_us,
        "submit_cpu_us": submit_cpu_us,
        "memory_per_job": memory_per_job,
    }


@pytest.mark.parametrize(
    ("mili", "verdicts"),
    [
        (figures(1200, 0.9, redis_cpu_us=40, submit_cpu_us=100), ["met", "met", "met", "missed", "met"]),
        (figures(1199, 1.1), ["missed", "missed", "missed", "missed", "missed"]),
    ],
)
def test_target_rows_compare_mili_with_the_best_peer_of_each_column(capsys, mili, verdicts):
    table = {
        "mili": mili,
        "dramatiq": figures(1000, 1.5),
        "arq": figures(400, 1.0),  # the quickest peer, not the fastest
        "mili-16": figures(100, 5.0, memory_per_job=1025),  # never a peer
    }
    assert report.best_peers(table)["jobs_per_s"] == "dramatiq"
    assert report.best_peers(table)["added_p50_ms"] == "arq"
    report.print_targets(table)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "target" not in line]
    assert [row.rsplit("|", 2)[1].strip() for row in rows] == verdicts
