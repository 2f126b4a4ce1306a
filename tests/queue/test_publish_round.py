"""PUBLISH_ROUND, a publication round's PUBLISHes of several jobs in one call, and APPEND_ROUND, its
appends (a running job's tokens alone) in one call: each job is answered and written exactly as its
own PUBLISH would answer and write it, whatever the others' outcomes; a job whose keys refuse the
protocol gets its error in its place and the others are published; and the worker's round
(JobCommands.publish) splits its jobs into calls of at most ROUND_JOBS, of one hash slot each on a
cluster, its appends apart, answering every update in its order."""

import itertools
import json
import uuid

import pytest
import redis
from redis.crc import key_slot

from producer_client.connection import connect
from producer_client.keys import Keys
from producer_client.protocol import worker as scripts
from producer_client.protocol.execution import execute
from producer_client.protocol.replication import Replication
from producer_client.protocol.replies import Published
from producer_client.protocol.worker import (
    APPEND_ROUND,
    PUBLISH,
    PUBLISH_ROUND,
    WORKER_SCRIPTS,
    append_round,
    publish_round,
)
from producer_client.schema import JobResult
from worker.loop import job_commands
from worker.loop.job_commands import ROUND_JOBS, JobCommands
from worker.loop.outbox import Update
from worker.loop.queue import ReplicasBehind, is_transient

KEYS = Keys()
START = json.dumps({"worker": "w1"})


def tokens(*ids):
    return json.dumps({"ids": list(ids), "text": "".join(chr(96 + i) for i in ids)})


def result(job_id, status="done"):
    return status, JobResult(id=job_id, status=status, text="abc").model_dump_json()


# (name, the job's hash before, PUBLISH's ARGV but for the job id in the result JSON, its reply)
CASES = [
    ("first", {"status": "running", "run": "r1"}, lambda j: ("r1", START, tokens(1, 2), 0, 2), "ok"),
    ("next", {"status": "running", "run": "r1", "tokens": "2", "started": "r1"}, lambda j: ("r1", "", tokens(3), 2, 3), "ok"),
    ("again", {"status": "running", "run": "r1", "tokens": "3", "started": "r1"}, lambda j: ("r1", "", tokens(3), 2, 3), "ok"),
    ("partial", {"status": "running", "run": "r1", "tokens": "2", "started": "r1"}, lambda j: ("r1", "", tokens(1, 2, 3), 0, 3), "partial:2"),
    ("followed", {"status": "running", "run": "r1", "streamed": "1"}, lambda j: ("r1", START, tokens(1), 0, 1), "followed"),
    ("cancel", {"status": "running", "run": "r1", "cancel": "1"}, lambda j: ("r1", START, tokens(1), 0, 1), "cancel"),
    ("lost", {"status": "running", "run": "r2"}, lambda j: ("r1", START, tokens(1), 0, 1), "lost"),
    ("gone", {}, lambda j: ("r1", START, tokens(1), 0, 1), "gone"),
    ("resumed", {"status": "running", "run": "r2", "tokens": "1", "started": "r1"}, lambda j: ("r2", START, tokens(2), 1, 2), "ok"),
    ("final", {"status": "running", "run": "r1", "fingerprint": "f"}, lambda j: ("r1", START, tokens(1, 2, 3), 0, 3, *result(j)), "written"),
    ("final-streamed", {"status": "running", "run": "r1"}, lambda j: ("r1", START, tokens(1), 0, 1, *result(j), 60, "1"), "written"),
    ("ended", {"status": "done", "result": "{}"}, lambda j: ("r1", "", tokens(4), 3, 4, *result(j, "failed")), "ended"),
]  # fmt: skip


def argv(case, job_id):
    """The case's ARGV in full: no final step, the result TTL, not streamed, where it says none."""
    args = case[2](job_id)
    return args if len(args) == scripts.PUBLISH_ARGS else (*args, *[""] * (7 - len(args)), 60, "")


def prepared(redis_client, case) -> str:
    job_id = uuid.uuid4().hex
    if case[1]:
        redis_client.hset(KEYS.job(job_id), mapping=case[1])
    return job_id


def job_keys(job_id):
    return KEYS.job(job_id), KEYS.events(job_id), KEYS.done(job_id)


def state(redis_client, job_id):
    """What the job's keys hold, its own id and the entries' ids left out (the hash's `last`, the
    id of the last event, as which of the events it names)."""
    entries = redis_client.xrange(KEYS.events(job_id))
    ids = {entry_id: f"event {i}" for i, (entry_id, _) in enumerate(entries)}
    hash_ = {k: v.replace(job_id, "ID") for k, v in redis_client.hgetall(KEYS.job(job_id)).items()}
    if "last" in hash_:
        hash_["last"] = ids.get(hash_["last"], hash_["last"])
    events = [f for _, f in entries]
    done = [f["data"].replace(job_id, "ID") for _, f in redis_client.xrange(KEYS.done(job_id))]
    ttl = [min(redis_client.ttl(key), 1) for key in (KEYS.job(job_id), KEYS.events(job_id))]  # 1: one set
    return hash_, [{k: v.replace(job_id, "ID") for k, v in e.items()} for e in events], done, ttl


def evalsha(redis_client, script, keys, args):
    return execute(redis_client, lambda pipe: pipe.evalsha(script.sha, len(keys), *keys, *args), WORKER_SCRIPTS)[0]


def test_a_round_answers_and_writes_each_job_as_its_own_publish_would(redis_client):
    alone = [prepared(redis_client, case) for case in CASES]
    replies = [evalsha(redis_client, PUBLISH, job_keys(j), argv(c, j)) for c, j in zip(CASES, alone)]
    assert replies == [case[3] for case in CASES]
    together = [prepared(redis_client, case) for case in CASES]
    keys = [key for j in together for key in job_keys(j)]
    args = [arg for c, j in zip(CASES, together) for arg in argv(c, j)]
    assert evalsha(redis_client, PUBLISH_ROUND, keys, args) == replies
    for case, a, b in zip(CASES, alone, together):
        assert state(redis_client, b) == state(redis_client, a), case[0]


# (name, the job's hash before, an append's (run, tokens, before, after), PUBLISH's reply): every
# state a running job's hash can be in when its run's tokens alone are published.
APPEND_CASES = [
    ("next", {"status": "running", "run": "r1", "tokens": "2", "started": "r1"}, ("r1", tokens(3), 2, 3), "ok"),
    ("first-tokens", {"status": "running", "run": "r1", "started": "r1"}, ("r1", tokens(1), 0, 1), "ok"),
    ("again", {"status": "running", "run": "r1", "tokens": "3", "started": "r1"}, ("r1", tokens(3), 2, 3), "ok"),
    ("partial", {"status": "running", "run": "r1", "tokens": "2", "started": "r1"}, ("r1", tokens(1, 2, 3), 0, 3), "partial:2"),
    ("behind", {"status": "running", "run": "r1", "tokens": "5", "started": "r1"}, ("r1", tokens(3), 2, 3), "lost"),
    ("followed", {"status": "running", "run": "r1", "tokens": "1", "started": "r1", "streamed": "1"}, ("r1", tokens(2), 1, 2), "followed"),
    ("cancel", {"status": "running", "run": "r1", "tokens": "1", "started": "r1", "cancel": "1", "streamed": "1"}, ("r1", tokens(2), 1, 2), "cancel"),
    ("lost", {"status": "running", "run": "r2", "tokens": "1", "started": "r2"}, ("r1", tokens(2), 1, 2), "lost"),
    ("gone", {}, ("r1", tokens(2), 1, 2), "gone"),
    ("unstarted", {"status": "running", "run": "r1", "tokens": "1"}, ("r1", tokens(2), 1, 2), "ok"),
    ("resumes", {"status": "running", "run": "r2", "tokens": "1", "started": "r1"}, ("r2", tokens(2), 1, 2), "ok"),
    ("resumed", {"status": "running", "run": "r2", "tokens": "1", "started": "r1", "resumed": "1"}, ("r2", tokens(2), 1, 2), "ok"),
    ("ended", {"status": "done", "result": "{}", "tokens": "3"}, ("r1", tokens(4), 3, 4), "ended"),
]  # fmt: skip


def test_an_append_round_answers_and_writes_each_job_as_its_own_publish_would(redis_client):
    alone = [prepared(redis_client, case) for case in APPEND_CASES]
    replies = []
    for (_, _, (run, data, before, after), _), job_id in zip(APPEND_CASES, alone):
        args = (run, "", data, before, after, "", "", 60, "")
        replies.append(evalsha(redis_client, PUBLISH, job_keys(job_id), args))
    assert replies == [case[3] for case in APPEND_CASES]
    together = [prepared(redis_client, case) for case in APPEND_CASES]
    call = append_round(KEYS, [(j, *case[2]) for case, j in zip(APPEND_CASES, together)])
    assert call.script is APPEND_ROUND and len(call.keys) == 2 * len(together) and len(call.args) == 4 * len(together)
    assert evalsha(redis_client, APPEND_ROUND, call.keys, call.args) == replies
    for case, a, b in zip(APPEND_CASES, alone, together):
        assert state(redis_client, b) == state(redis_client, a), case[0]


def test_an_append_whose_keys_refuse_gets_its_error_in_its_place_and_the_others_are_appended(redis_client):
    jobs = [prepared(redis_client, APPEND_CASES[0]) for _ in range(3)]
    redis_client.hset(KEYS.events(jobs[1]), "a", "b")  # a producer's key of another type
    refused = (KEYS.job(jobs[1]), KEYS.events(jobs[1]))
    before = [redis_client.dump(key) for key in refused]
    call = append_round(KEYS, [(j, "r1", tokens(3), 2, 3) for j in jobs])
    replies = evalsha(redis_client, APPEND_ROUND, call.keys, call.args)
    assert replies[0] == replies[2] == "ok"
    assert type(replies[1]) is redis.ResponseError and str(replies[1]).startswith("WRONGTYPE")
    assert [redis_client.dump(key) for key in refused] == before  # nothing of it written
    for j in (jobs[0], jobs[2]):
        assert redis_client.hget(KEYS.job(j), "tokens") == "3"


@pytest.mark.parametrize("name", ["first", "followed", "resumed", "again"])
def test_a_publication_that_does_not_end_its_job_writes_the_hash_with_one_hset(redis_server, name):
    """A run's first publication (its start, its tokens, the run's record of its last event, a
    resumed run's flag) or a repeated one: the hash's fields in one HSET, where each command a
    script calls costs Redis about as much again as the fields it writes (issue 43)."""
    case = next(c for c in CASES if c[0] == name)
    client = connect(redis_server.url, decode_responses=True)
    try:
        job_id = prepared(client, case)
        client.config_resetstat()
        assert evalsha(client, PUBLISH, job_keys(job_id), argv(case, job_id)) == case[3]
        assert client.info("commandstats")["cmdstat_hset"]["calls"] == 1
    finally:
        client.close()


@pytest.mark.parametrize("final", [False, True], ids=["step", "final step"])
def test_a_job_whose_keys_refuse_gets_its_error_in_its_place_and_the_others_are_published(redis_client, final):
    jobs = [prepared(redis_client, CASES[0]) for _ in range(3)]
    redis_client.hset(KEYS.events(jobs[1]), "a", "b")  # a producer's key of another type
    refused = (KEYS.job(jobs[1]), KEYS.events(jobs[1]))
    before = [redis_client.dump(key) for key in refused]
    calls = [
        scripts.publish(KEYS, j, "r1", START, tokens(1), 0, 1, *(result(j) if final else ("", "")), 60) for j in jobs
    ]
    replies = evalsha(redis_client, PUBLISH_ROUND, publish_round(calls).keys, publish_round(calls).args)
    assert replies[0] == replies[2] == ("written" if final else "ok")
    assert type(replies[1]) is redis.ResponseError and str(replies[1]).startswith("WRONGTYPE")
    assert not is_transient(replies[1])
    assert [redis_client.dump(key) for key in refused] == before  # nothing of it written
    for j in (jobs[0], jobs[2]):
        assert redis_client.hget(KEYS.job(j), "tokens") == "1"


def test_a_round_refused_for_memory_answers_each_job_the_error_to_try_again(redis_client):
    """Redis refuses a script's writes past maxmemory: each job's reply is OutOfMemoryError, which
    the worker keeps the update for (as its own call's), and nothing is written."""
    jobs = [prepared(redis_client, CASES[0]) for _ in range(3)]
    calls = [scripts.publish(KEYS, j, "r1", START, tokens(1), 0, 1, "", "", 60) for j in jobs]
    redis_client.config_set("maxmemory", 1)
    try:
        replies = evalsha(redis_client, PUBLISH_ROUND, publish_round(calls).keys, publish_round(calls).args)
    finally:
        redis_client.config_set("maxmemory", 0)
    assert [type(reply) for reply in replies] == [redis.exceptions.OutOfMemoryError] * 3
    assert all(is_transient(reply) for reply in replies)
    assert [redis_client.hget(KEYS.job(j), "tokens") for j in jobs] == [None] * 3
    assert not any(redis_client.exists(KEYS.events(j)) for j in jobs)


def updates_of(redis_client, n: int, lost_every: int) -> tuple[list[Update], list[Published]]:
    """`n` running jobs' first updates, every `lost_every`-th job's run being another's."""
    updates, outcomes = [], []
    for i in range(n):
        job_id = uuid.uuid4().hex
        lost = i % lost_every == 0
        redis_client.hset(KEYS.job(job_id), mapping={"status": "running", "run": "r0" if lost else "r1"})
        update = Update(job_id, f"{i + 1}-0", "r1", 0, start=START)
        update.add_cut([1, 2], "ab", None)
        updates.append(update)
        outcomes.append(Published.LOST if lost else Published.OK)
    return updates, outcomes


def counted_rounds(monkeypatch) -> list[int]:
    sizes: list[int] = []

    def counting(calls):
        sizes.append(len(calls))
        return publish_round(calls)

    monkeypatch.setattr(job_commands.scripts, "publish_round", counting)
    return sizes


def counted_appends(monkeypatch) -> list[int]:
    sizes: list[int] = []

    def counting(keys, appends):
        sizes.append(len(appends))
        return append_round(keys, appends)

    monkeypatch.setattr(job_commands.scripts, "append_round", counting)
    return sizes


def test_a_full_round_goes_in_calls_of_at_most_round_jobs_each_update_answered_in_its_order(redis_client, monkeypatch):
    sizes = counted_rounds(monkeypatch)
    updates, outcomes = updates_of(redis_client, 2 * ROUND_JOBS + 1, lost_every=7)
    published, watched = JobCommands(redis_client, KEYS, "w1", 60).publish(updates, [])
    assert [reply.outcome for reply in published] == outcomes
    assert watched == []
    assert sizes == [ROUND_JOBS, ROUND_JOBS]  # and the last job alone, as PUBLISH
    for update, outcome in zip(updates, outcomes):
        recorded = redis_client.hget(KEYS.job(update.job_id), "tokens")
        assert recorded == (None if outcome is Published.LOST else "2")


def test_a_rounds_appends_go_in_append_round_calls_and_each_update_is_answered_in_its_order(redis_client, monkeypatch):
    """A round of first publications (a start each) and of appends (tokens alone), mixed: the appends
    go in APPEND_ROUND calls of at most ROUND_JOBS, the others in PUBLISH_ROUND, and every update is
    answered in its own place."""
    sizes, appended = counted_rounds(monkeypatch), counted_appends(monkeypatch)
    starts, start_outcomes = updates_of(redis_client, 3, lost_every=2)
    appends, append_outcomes = [], []
    for i in range(ROUND_JOBS + 2):
        job_id = uuid.uuid4().hex
        run = "r0" if i % 5 == 0 else "r1"
        redis_client.hset(KEYS.job(job_id), mapping={"status": "running", "run": run, "started": run, "tokens": "2"})
        update = Update(job_id, f"{i + 10}-0", "r1", 2)
        update.add_cut([3], "c", None)
        appends.append(update)
        append_outcomes.append(Published.LOST if run == "r0" else Published.OK)
    updates = [u for pair in itertools.zip_longest(starts, appends) for u in pair if u is not None]
    outcomes = [o for pair in itertools.zip_longest(start_outcomes, append_outcomes) for o in pair if o is not None]
    published, _ = JobCommands(redis_client, KEYS, "w1", 60).publish(updates, [])
    assert [reply.outcome for reply in published] == outcomes
    assert sizes == [3] and appended == [ROUND_JOBS, 2]
    for update, outcome in zip(appends, append_outcomes):
        assert redis_client.hget(KEYS.job(update.job_id), "tokens") == ("2" if outcome is Published.LOST else "3")


def slot_of(job_id: str) -> int:
    return key_slot(KEYS.job(job_id).encode())


def same_slot_pair() -> tuple[str, str]:
    """Two job ids whose keys share a hash slot (about 160 tries: the birthday bound of 16,384)."""
    seen: dict[int, str] = {}
    for i in itertools.count():
        job_id = f"pair-{i}"
        if slot_of(job_id) in seen:
            return seen[slot_of(job_id)], job_id
        seen[slot_of(job_id)] = job_id
    raise AssertionError("unreachable")


def test_on_a_cluster_a_round_publishes_the_jobs_of_one_slot_together(redis_cluster, monkeypatch):
    sizes, appended = counted_rounds(monkeypatch), counted_appends(monkeypatch)
    client = connect(redis_cluster.url, decode_responses=True)
    try:
        pair = same_slot_pair()
        job_ids = [*pair, next(j for j in iter(lambda: uuid.uuid4().hex, "") if slot_of(j) != slot_of(pair[0]))]
        updates = []
        for job_id in job_ids:
            client.hset(KEYS.job(job_id), mapping={"status": "running", "run": "r1"})
            update = Update(job_id, "1-0", "r1", 0, start=START)
            update.add_cut([1], "a", None)
            updates.append(update)
        published, _ = JobCommands(client, KEYS, "w1", 60).publish(updates, [])
        assert [reply.outcome for reply in published] == [Published.OK] * 3
        assert sizes == [2]  # the pair in one call, the third job (another slot) in its own
        assert [client.hget(KEYS.job(j), "tokens") for j in job_ids] == ["1"] * 3
        appends = [Update(job_id, "1-0", "r1", 1) for job_id in job_ids]
        for update in appends:
            update.add_cut([2], "b", None)
        published, _ = JobCommands(client, KEYS, "w1", 60).publish(appends, [])
        assert [reply.outcome for reply in published] == [Published.OK] * 3
        assert appended == [2, 1]  # APPEND_ROUND by slot likewise
        assert [client.hget(KEYS.job(j), "tokens") for j in job_ids] == ["2"] * 3
    finally:
        client.close()


def test_a_round_deletes_the_due_done_streams_in_one_unlink_on_one_server_and_one_a_key_on_a_cluster(
    redis_server, redis_cluster
):
    """The done streams of the jobs the worker ended DONE_TTL_MS ago go with its round: on one
    server in one UNLINK (a command a stream cost Redis about half as much again), on a cluster one
    a key, each to its node (their slots differ: one UNLINK of them all would be refused)."""
    for url, unlinks in ((redis_server.url, 1), (redis_cluster.url, 3)):
        client = connect(url, decode_responses=True)
        try:
            job_ids = [uuid.uuid4().hex for _ in range(3)]
            for job_id in job_ids:
                client.xadd(KEYS.done(job_id), {"data": "{}"})
            # The masters alone: a replica counts the UNLINKs its master sends it, whenever they arrive.
            nodes = client.get_primaries() if unlinks > 1 else [None]
            for node in nodes:
                client.config_resetstat(**({"target_nodes": node} if node else {}))
            assert JobCommands(client, KEYS, "w1", 60).publish([], [], forget=job_ids) == ([], [])
            assert sum(client.exists(KEYS.done(j)) for j in job_ids) == 0
            stats = [client.info("commandstats", **({"target_nodes": node} if node else {})) for node in nodes]
            assert sum(s.get("cmdstat_unlink", {"calls": 0})["calls"] for s in stats) == unlinks
        finally:
            client.close()


def test_a_rounds_wait_for_replicas_is_read_past_its_unlink_of_the_due_done_streams(redis_server):
    """A final result whose replicas the round waits for (EXPIRE, WAIT after the UNLINK of the done
    streams due): the WAIT's own reply is the one read, 0 replicas on a server that has none, so
    the result answers ReplicasBehind (its entry is not acknowledged yet), not the EXPIRE's 1."""
    client = connect(redis_server.url, decode_responses=True)
    try:
        job_id, ended = uuid.uuid4().hex, [uuid.uuid4().hex for _ in range(3)]
        client.hset(KEYS.job(job_id), mapping={"status": "running", "run": "r1"})
        for done_id in ended:
            client.xadd(KEYS.done(done_id), {"data": "{}"})
        update = Update(job_id, "1-0", "r1", 0, start=START)
        update.add_cut([1], "a", None)
        update.final = JobResult(id=job_id, status="done", text="a", token_ids=[1])
        commands = JobCommands(client, KEYS, "w1", 60, Replication(replicas=1, timeout_ms=1))
        (reply,), _ = commands.publish([update], [], forget=ended)
        assert isinstance(reply, ReplicasBehind)
        assert str(reply).startswith(f"job {job_id}: its result is written, 0 of 1 replicas confirmed it")
        assert client.hget(KEYS.job(job_id), "status") == "done"
        assert sum(client.exists(KEYS.done(j)) for j in ended) == 0
    finally:
        client.close()


def test_an_append_rounds_call_names_each_jobs_keys_and_arguments_in_the_order_its_lua_reads_them():
    """KEYS: job and events of each job; ARGV: run, tokens JSON, tokens before and after, of each."""
    call = append_round(KEYS, [("a", "r1", tokens(1), 0, 1), ("b", "r2", tokens(2, 3), 5, 7)])
    assert call.keys == (KEYS.job("a"), KEYS.events("a"), KEYS.job("b"), KEYS.events("b"))
    assert call.args == ("r1", tokens(1), 0, 1, "r2", tokens(2, 3), 5, 7)
    assert append_round(KEYS, []) == (APPEND_ROUND, (), ())
