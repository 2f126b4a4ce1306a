"""bench/peers.py's accounting: Redis time charged to the command or script that spent it, per
job, and the verdicts of its target rows."""

import os
import subprocess
import sys

import pytest

from bench import peers
from bench.peer_queues import report
from bench.peer_queues.job import URL_VARIABLE
from bench.peer_queues.processes import ProducerProcess, pinned
from bench.peer_queues.producer import WARMUP_JOBS, Chunk, chunk_sizes, submit_summary
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


@pytest.mark.parametrize(
    ("same_core", "apart", "verdict"),
    [(70, 120, "missed"), (70, 100, "met"), (101, 90, "missed"), (100, None, "met")],
)
def test_the_submit_row_is_met_only_where_both_placements_are_in_budget(same_core, apart, verdict):
    """A user's producer may share redis-server's core or sleep for each reply on another one: the
    row holds for both (a machine of one CPU measures the first alone)."""
    mili = {"submit_cpu_us": same_core} | ({} if apart is None else {"apart_submit_cpu_us": apart})
    target, figure, met = report.submit_row(mili)
    assert met == (verdict == "met")
    assert f"{same_core} us with Redis on its core" in figure
    assert apart is None or f"{apart} us with Redis on another" in figure


def test_a_submits_cpu_counts_every_part_and_shows_the_lowest_and_highest():
    chunks = [Chunk(200, 0.014, 0.03, 1, 199), Chunk(200, 0.030, 0.05, 200, 2), Chunk(100, 0.006, 0.01, 0, 100)]
    summary = submit_summary(chunks, [(197, 100), (199, 101), (197, 100)])
    assert summary["submit_cpu_us"] == pytest.approx(50_000 / 500)  # 0.050 s over 500 submits, the slow part too
    assert summary["submit_wall_us"] == pytest.approx(90_000 / 500)
    assert (summary["submit_cpu_low_us"], summary["submit_cpu_high_us"]) == pytest.approx((60, 150))
    assert (summary["submit_slept"], summary["submit_preempted"]) == pytest.approx((201 / 500, 301 / 500))
    assert (summary["submit_calls"], summary["submit_python_calls"]) == (197, 100)


@pytest.mark.parametrize(("jobs", "sizes"), [(2000, [200] * 10), (25, [3] * 5 + [2] * 5), (3, [1, 1, 1])])
def test_the_timed_submits_are_split_into_even_parts(jobs, sizes):
    assert chunk_sizes(jobs) == sizes


def test_pinned_keeps_every_thread_of_a_process_to_the_cpus_then_gives_back_its_own():
    allowed = os.sched_getaffinity(0)
    code = "import threading, time; threading.Thread(target=time.sleep, args=(30,)).start(); print(1, flush=True); time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        process.stdout.readline()  # its second thread has started
        tids = [int(t) for t in os.listdir(f"/proc/{process.pid}/task")]
        assert len(tids) == 2
        one = {min(allowed)}
        with pinned(process.pid, one):
            assert [os.sched_getaffinity(tid) for tid in tids] == [one, one]
        assert [os.sched_getaffinity(tid) for tid in tids] == [allowed, allowed]
    finally:
        process.kill()
        process.wait()


def test_a_submit_run_reports_its_parts_and_switches_from_a_pinned_producer(redis_server):
    """The submit mode of MILI's producer, kept to one CPU as bench/peers.py runs it."""
    env = dict(os.environ, PYTHONPATH=str(peers.ROOT), **{URL_VARIABLE: redis_server.url})
    cpu = {min(os.sched_getaffinity(0))}
    figures = ProducerProcess.one_run(sys.executable, "mili", env, ["submit", "--jobs", "40"], cpu)
    assert figures["submit_cpu_low_us"] <= figures["submit_cpu_us"] <= figures["submit_cpu_high_us"]
    assert figures["submit_slept"] >= 0 and figures["submit_preempted"] >= 0
    assert figures["submit_python_calls"] > 0


def test_a_count_run_submits_its_jobs_between_the_go_and_its_line(redis_server, redis_client):
    """The producer's count mode: nothing but the submits between the go (callgrind zeroed) and its
    {"submits": N} line (callgrind dumped), every one enqueued."""
    from producer_client.keys import Keys

    redis_client.delete(Keys().queue("bench"))
    env = dict(os.environ, PYTHONPATH=str(peers.ROOT), **{URL_VARIABLE: redis_server.url})
    producer = ProducerProcess(sys.executable, "mili", env, ["count", "--jobs", "7"])
    assert producer.expect() == {"ready": True}
    assert redis_client.xlen(Keys().queue("bench")) == WARMUP_JOBS
    producer.send()
    assert producer.expect() == {"submits": 7}
    assert redis_client.xlen(Keys().queue("bench")) == WARMUP_JOBS + 7
    producer.finish()
    assert producer.process.returncode == 0


def test_lua_costs_whole_path_counts_each_jobs_submit_its_blocked_wait_and_its_settlement():
    """bench.lua_costs --wait: a job's submit goes as generate() sends it (its create, its entry and
    the blocking read of its done stream in one round trip), the PUBLISH_ROUND that ends it wakes
    that read, and the worker's acknowledgement and deletion of its entry are counted too."""
    from bench import lua_costs

    run = lua_costs.one_run(12, 6, 1, "", wait=True)
    assert run["whole:submit"]["commands"] == {"hsetnx": 1.0, "xadd": 1.0, "xread": 1.0}
    assert run["whole:settle"]["commands"] == {"xack": 1 / 6, "xdel": 1 / 6}
    assert run["whole:publish_round"]["commands"] == run["publish_round"]["commands"]
    assert set(lua_costs.WHOLE_PHASES) <= {p.removeprefix("whole:") for p in run if p.startswith("whole:")}
    assert "create" in run and set(lua_costs.PHASES) <= set(run)
