"""The ACL split of docs/security.md, run as written against a real redis-server: a producer user can do
everything the client does and nothing a worker does; a worker user can run the queue loop
and the healthcheck, and nothing outside the `mili:` prefix; a gateway user runs a batch of the
Batch API and can do no more than a producer to a job."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import redis

from cli.__main__ import main as mili
from harness.polling import eventually
from producer_client import Client, IdempotencyConflict, PermissionDenied
from producer_client.keys import GROUP, PROTOCOL_VERSION, Keys
from producer_client.placement import Placed
from producer_client.protocol.execution import execute
from producer_client.protocol.producer import LaneJob, enqueue_lanes
from tests.support.acl import acl_server
from tests.support.gateways import GatewayProcess
from tests.support.workers import WorkerProcess
from worker.healthcheck import healthcheck
from worker.settings import WorkerSettings


@pytest.fixture
def acl_redis():
    """A TCP redis-server with the documented users; the default user stays the admin."""
    with acl_server() as server:
        yield server


@pytest.fixture
def acl_worker(acl_redis, tmp_path, no_mili_environment):
    """An echo worker of the default queue, connected as the worker user (its heartbeat, read as
    that user, says it started under the ACL)."""
    worker = WorkerProcess(acl_redis["worker"], None, "acl-worker", tmp_path, model="echo")
    yield worker.start().wait_ready()
    worker.stop()


def test_the_producer_user_can_do_what_the_client_does(acl_redis, acl_worker):
    with Client(acl_redis["producer"]) as client:
        job = client.submit(prompt="hello acl", max_tokens=32)
        assert client.result(job, timeout=30).text == "hello acl"
        assert "".join(delta.text for delta in client.stream(job)) == "hello acl"
        assert client.status(job).status == "done"
        client.cancel(job)  # of a finished job: runs the cancel script, changes nothing
        assert client.queue_stats().workers == ["acl-worker"]
        first = client.submit(prompt="once", max_tokens=8, request_id="acl-request")  # HSETNX path
        assert client.submit(prompt="once", max_tokens=8, request_id="acl-request") == first
        with pytest.raises(IdempotencyConflict):  # the same id, another request
            client.submit(prompt="other", max_tokens=8, request_id="acl-request")
        assert client.result(first, timeout=30).text == "once"
        many = client.submit_many(
            [{"prompt": f"bulk {i}", "max_tokens": 8} for i in range(3)] + [{"prompt": "r", "request_id": "acl-bulk"}]
        )
        assert sorted(r.text for r in client.as_completed(many, timeout=30)) == ["bulk 0", "bulk 1", "bulk 2", "r"]
        client.cancel_many(many)
        team = client.as_tenant("acl-team")  # the sharing rules' keys: a lane's stream, a tenant's quota
        laned = team.submit(prompt="flex lane", max_tokens=16, service_tier="flex")
        assert team.result(laned, timeout=30).text == "flex lane"
        assert team.rate_limits().limited is False


def readme_calls(client: Client) -> None:
    """README.md's client calls, each checked: what a producer's user is promised it may run."""
    job = client.submit(prompt="readme", max_tokens=8)
    assert client.result(job, timeout=30).text == "readme"
    chat = client.submit(messages=[{"role": "user", "content": "Hi"}], max_tokens=64, stream=True)
    assert "".join(delta.text for delta in client.stream(chat))
    assert client.status(job).status == "done"
    client.cancel(chat)  # ended: the cancel script runs and changes nothing
    assert client.generate(prompt="Hello", max_tokens=8).text == "Hello"
    assert [w.name for w in client.workers()] == ["acl-worker"]
    assert client.wait(client.submit(prompt="waited", max_tokens=8), timeout=30).text == "waited"
    other = client.on_queue("acl-batch").submit(prompt="Hi")
    client.cancel(other)  # no worker serves that queue: cancelled while queued
    assert client.status(other).status == "cancelled"
    ids = client.submit_many([{"prompt": p, "max_tokens": 16} for p in ["a", "b"]])
    assert sorted(r.text for r in client.as_completed(ids, timeout=30)) == ["a", "b"]
    assert [r.text for r in client.results(ids, timeout=30)] == ["a", "b"]


@pytest.fixture
def mili_as(capsys):
    """Runs `mili` in process as a URL's user: its exit status, and whether Redis refused it."""

    def run(url: str, *args: str) -> tuple[int, bool]:
        code = mili(["--redis", url, *args])
        return code, capsys.readouterr().err.startswith("error: redis_refused: Redis refused ")

    return run


@pytest.mark.parametrize("user", ["producer", "gateway"])
def test_readmes_producer_calls_and_commands_run_as_the_producer_and_gateway_users(
    user, acl_redis, acl_worker, mili_as
):
    """Every client call README.md shows, and the `mili` commands docs/operating-the-queue.md gives
    producers: `mili workers` and `client.inspect.workers()` read each heartbeat's PTTL (live or
    stale), which the documented users lacked; the dead letters and every tenant's quota stay the
    workers' user's (NOPERM)."""
    url = acl_redis[user]
    with Client(url) as client:
        readme_calls(client)
        assert client.queue_stats().workers == ["acl-worker"]
        assert [(w.name, w.condition) for w in client.inspect.workers()] == [("acl-worker", "live")]
        assert client.inspect.queues() == ["default"]
        assert client.inspect.waiting(5) == [] and client.inspect.running(5) == []
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.dead_letters.list(5)
        with pytest.raises(redis.exceptions.NoPermissionError):  # PTTL is the heartbeats' alone
            client.redis.pttl(Keys().job("x"))
    for command in (["stats"], ["stats", "--all"], ["workers"], ["jobs", "--status", "queued"], ["quota", "show", "t"]):
        assert mili_as(url, *command) == (0, False), command
    for command in (["dead", "list"], ["jobs", "--status", "dead"], ["quota", "show"]):
        assert mili_as(url, *command) == (1, True), command
        assert mili_as(acl_redis["worker"], *command) == (0, False), command


def test_a_tenants_pinned_user_runs_readmes_calls_as_its_tenant(acl_redis, acl_worker, mili_as):
    """docs/security.md's user pinned to team-a runs README.md's client calls, `mili workers` and
    its own quota; the queue's stats read every tenant's streams, which it may not (NOPERM)."""
    url = acl_redis["team-a"]
    with Client(url, tenant="team-a", placement=False) as client:
        readme_calls(client)
        assert [(w.name, w.condition) for w in client.inspect.workers()] == [("acl-worker", "live")]
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.queue_stats()
    assert mili_as(url, "--tenant", "team-a", "workers") == (0, False)
    assert mili_as(url, "--tenant", "team-a", "quota", "show", "team-a") == (0, False)
    assert mili_as(url, "--tenant", "team-a", "stats") == (1, True)


def test_a_tenants_pinned_user_runs_a_batch_file_as_its_tenant(acl_redis, acl_worker, mili_as, tmp_path):
    """`mili batch` is a producer's command (README.md): its lines' jobs are the tenant's, with ids
    that begin with the tenant, which its pinned user may touch (they began `batch.`: NOPERM)."""
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "echo", **body}}
        for i, body in enumerate([{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}] * 2)
    ]
    lines[1]["body"]["service_tier"] = "priority"
    source, output = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert mili_as(acl_redis["team-a"], "--tenant", "team-a", "batch", str(source), "-o", str(output)) == (0, False)
    answers = [json.loads(text) for text in output.read_text().splitlines()]
    assert sorted((a["custom_id"], a["response"]["body"]["service_tier"]) for a in answers) == [
        ("c0", "flex"),
        ("c1", "priority"),
    ]
    assert all(a["response"]["request_id"].startswith("team-a.") for a in answers)


def test_the_producer_user_cannot_act_as_a_worker(acl_redis, acl_worker):
    producer = redis.Redis.from_url(acl_redis["producer"], decode_responses=True)
    stream = Keys().queue("default")
    entry = producer.xadd(stream, {"id": "raw", "v": str(PROTOCOL_VERSION), "body": "{}"})
    forbidden = [
        lambda: producer.xreadgroup(GROUP, "intruder", {stream: ">"}, count=1),
        lambda: producer.xack(stream, GROUP, entry),
        lambda: producer.xdel(stream, entry),
        lambda: producer.xgroup_destroy(stream, GROUP),
        lambda: producer.hset(Keys().worker("acl-worker"), "state", "fake"),
        lambda: producer.expire(Keys().job("raw"), 1),
        lambda: producer.get("not-mili"),
        lambda: producer.flushall(),
    ]
    for command in forbidden:
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    producer.close()


def test_the_worker_user_runs_the_healthcheck_and_stays_in_its_prefix(acl_redis, acl_worker):
    assert healthcheck(WorkerSettings(redis=acl_redis["worker"], name="acl-worker")) == 0
    worker = redis.Redis.from_url(acl_redis["worker"], decode_responses=True)
    for command in (lambda: worker.set("not-mili", 1), lambda: worker.flushall(), lambda: worker.config_get("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    worker.close()


def test_the_gateway_user_runs_a_batch_and_is_a_producer_to_jobs(acl_redis, acl_worker, tmp_path):
    gateway = GatewayProcess(acl_redis["gateway"], tmp_path, "--batch-poll-s", "0.1").start()
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        lines = [
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": "echo", "prompt": f"acl {i}", "max_tokens": 8},
            }
            for i in range(3)
        ]
        text = "".join(json.dumps(line) + "\n" for line in lines)
        file = sdk.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
        batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h")
        running = ("validating", "in_progress", "finalizing")
        assert eventually(lambda: sdk.batches.retrieve(batch.id).status not in running, 60), gateway.log()
        done = sdk.batches.retrieve(batch.id)
        assert done.status == "completed", gateway.log()
        texts = {
            json.loads(a)["custom_id"]: json.loads(a)["response"]["body"]["choices"][0]["text"]
            for a in sdk.files.content(done.output_file_id).text.splitlines()
        }
        assert texts == {f"c{i}": f"acl {i}" for i in range(3)}
        sdk.batches.cancel(
            sdk.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h").id
        )
        assert file.id in [f.id for f in sdk.files.list()]
        assert [f.id for f in sdk.files.list(order="asc", after=file.id)][0] == done.output_file_id
        assert sdk.files.delete(file.id).deleted
        # The board reads what only the workers' user may (docs/operating-the-queue.md): Redis's
        # refusal is the gateway's user's, a 500 redis_refused, not a 503 that says Redis is away.
        board = httpx.get(f"{gateway.url}/board")
        error = board.json()["error"]
        assert (board.status_code, error["type"], error["code"]) == (500, "server_error", "redis_refused")
        assert board.headers["x-should-retry"] == "false"  # no retry mends it: the SDKs ask once
        assert error["message"].startswith(
            "the queue's Redis refused the gateway's user: PermissionDenied: Redis refused "
        )
        assert "NOPERM" in error["message"] and "gateway-secret" not in error["message"]
    finally:
        sdk.close()
        gateway.stop()
    as_gateway = redis.Redis.from_url(acl_redis["gateway"], decode_responses=True)
    for command in (
        lambda: as_gateway.expire(Keys().job("x"), 1),
        lambda: as_gateway.xreadgroup(GROUP, "g", {Keys().queue("default"): ">"}),
        lambda: as_gateway.set("not-mili", 1),
        lambda: as_gateway.rpush(Keys().job("x"), 1),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    as_gateway.close()


def test_placement_reads_its_view_and_places_with_the_producers_rights_alone(acl_redis, acl_worker, tmp_path):
    """A second worker under the worker user: the producer user reads the worker index, the
    heartbeats and the workers' own streams' lengths, places each job on a worker's own stream,
    and the workers, under their user, read, steal and settle them there."""
    second = WorkerProcess(acl_redis["worker"], None, "acl-worker-2", tmp_path, model="echo")
    second.start().wait_ready()
    try:
        with Client(acl_redis["producer"]) as client:
            jobs = [client.submit(prompt=f"placed {i}", max_tokens=8) for i in range(6)]
            assert [r.text for r in client.results(jobs, timeout=30)] == [f"placed {i}" for i in range(6)]
            assert client.placement.placed == {Placed.AFFINITY: 6, Placed.SHARED: 0}
    finally:
        second.stop()


def test_a_tenants_pinned_user_submits_and_reads_as_its_tenant_and_no_other(acl_redis, acl_worker):
    """docs/security.md's user pinned to team-a: it runs team-a's jobs in every lane and reads their
    results, and Redis refuses it team-b's keys (its jobs' too, whose ids begin with the tenant:
    on main the user read and could cancel them), the jobs of no tenant and the workers' streams
    but their lengths; nothing it was refused was written."""
    keys, queue = Keys(), "default"
    with Client(acl_redis["producer"], tenant="team-b") as team_b:
        b_job = team_b.submit(prompt="team-b's", max_tokens=8, service_tier="flex")
    lanes = ("priority", "default", "flex")
    with Client(acl_redis["team-a"], tenant="team-a", placement=False) as team_a:
        jobs = [team_a.submit(prompt=f"a {lane}", max_tokens=16, service_tier=lane) for lane in lanes]
        assert [r.text for r in team_a.results(jobs, timeout=30)] == [f"a {lane}" for lane in lanes]
        assert "".join(delta.text for delta in team_a.stream(jobs[0])) == "a priority"
        assert team_a.rate_limits().limited is False
        assert team_a.submit(prompt="named", max_tokens=4, request_id="team-a.order-17") == "team-a.order-17"
        with pytest.raises(redis.exceptions.NoPermissionError):
            team_a.submit(prompt="named", max_tokens=4, request_id="order-18")  # not its tenant's id
        with pytest.raises(redis.exceptions.NoPermissionError):
            team_a.result(b_job, timeout=30)
        with pytest.raises(redis.exceptions.NoPermissionError):
            team_a.cancel(b_job)
    with Client(acl_redis["team-a"], tenant="team-b", placement=False) as posing:
        with pytest.raises(redis.exceptions.NoPermissionError):
            posing.submit(prompt="as team-b", max_tokens=8, service_tier="flex")
    as_a = redis.Redis.from_url(acl_redis["team-a"], decode_responses=True)
    b_flex, own = keys.lane_stream(queue, "flex", "team-b"), keys.own_queue(queue, "acl-worker")
    entry = {"id": "intruder", "v": "1", "body": "{}", "cost": "1"}
    forbidden = [
        lambda: as_a.xadd(b_flex, entry),
        lambda: as_a.xrange(b_flex),
        lambda: as_a.xread({b_flex: "0"}),
        lambda: as_a.xadd(keys.lane_stream(queue, "default", "team-b"), entry),
        lambda: as_a.xadd(keys.queue(queue), entry),  # the jobs of no tenant
        lambda: as_a.xrange(keys.queue(queue)),
        lambda: as_a.hset(keys.rate(queue, "team-b"), "r", "0"),
        lambda: as_a.hgetall(keys.quota("team-b")),
        lambda: as_a.hset(keys.quota("team-a"), "rpm", "1000000"),
        lambda: as_a.xadd(own, {**entry, "tenant": "team-b"}),
        lambda: as_a.xrange(own),
        lambda: execute(as_a, enqueue_lanes(keys, queue, "team-b", [LaneJob("flex", 1, "intruder", "{}")], 0).add_to),
        lambda: as_a.hgetall(keys.job(b_job)),
        lambda: as_a.hset(keys.job(b_job), "status", "cancelled"),
        lambda: as_a.xrange(keys.events(b_job)),
        lambda: as_a.xread({keys.done(b_job): "0"}),
        lambda: as_a.hgetall(keys.job("team-ab.0")),  # a tenant whose name begins as team-a's
    ]
    for command in forbidden:
        with pytest.raises(redis.exceptions.NoPermissionError):
            command()
    assert as_a.xlen(own) == 0  # placement's view reads the workers' own streams' lengths
    as_a.close()
    admin = acl_redis["admin"]
    assert [admin.exists(key) for key in (keys.lane_stream(queue, "default", "team-b"), keys.quota("team-b"))] == [0, 0]
    assert admin.xinfo_stream(b_flex)["entries-added"] == 1  # team-b's job, read and deleted by the worker
    assert admin.xinfo_stream(keys.queue(queue))["entries-added"] == 0
    assert admin.hget(keys.quota("team-a"), "rpm") is None
    assert admin.hget(keys.job(b_job), "status") == "done" and not admin.exists(keys.job("order-18"))


@pytest.mark.parametrize("user", ["producer", "gateway"])
def test_the_producer_and_gateway_users_list_the_queued_and_running_jobs(user, acl_redis, mili_as):
    """docs/security.md gives producers `mili jobs` of queued and running jobs: both read the
    entries themselves (XRANGE), which the documented users lacked, so each listing was refused
    as soon as it had a job to show. On a queue no worker serves: two waiting jobs, and one that
    a consumer of the workers' group holds (read by the admin, as a worker would)."""
    url = acl_redis[user]
    with Client(url, queue="acl-idle") as client:
        waiting = [client.submit(prompt=p, max_tokens=2) for p in ("first", "second")]
        stream = Keys().queue("acl-idle")
        acl_redis["admin"].xgroup_create(stream, GROUP, id="0")
        acl_redis["admin"].xreadgroup(GROUP, "held-by", {stream: ">"}, count=1)
        assert [job.job_id for job in client.inspect.waiting(5)] == waiting[1:]
        assert [job.job_id for job in client.inspect.running(5)] == waiting[:1]
        assert client.inspect.entry_of(client.status(waiting[1]), ["acl-idle"]).place == "waiting"
    for status in ("queued", "running"):
        assert mili_as(url, "--queue", "acl-idle", "jobs", "--status", status) == (0, False), status


def test_a_submit_the_acl_refuses_outright_is_one_line_with_no_clean_up_to_log(acl_redis, caplog):
    """A submit whose job hash the ACL refuses (team-a's pinned user naming no tenant) wrote nothing:
    the refusal alone is raised and, from mili, one line on stderr (docs/failure-semantics.md), where
    the client also tried to DEL the hash, which the same ACL refused, and logged 'the clean-up
    after PermissionDenied failed too', a second line before mili's error."""
    url = acl_redis["team-a"]
    with caplog.at_level(logging.WARNING, logger="producer_client"), Client(url, placement=False) as client:
        for submit in (
            lambda: client.submit(prompt="no tenant", max_tokens=2),
            lambda: client.generate(prompt="no tenant", max_tokens=2, timeout=5),
            lambda: client.submit_many([{"prompt": "no tenant", "max_tokens": 2}] * 2),
        ):
            with pytest.raises(PermissionDenied, match="HSETNX|EVALSHA"):
                submit()
    assert caplog.records == []
    refused = subprocess.run(
        [sys.executable, "-m", "cli", "--redis", url, "submit", "no tenant", "--max-tokens", "2"],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr.startswith("error: redis_refused: Redis refused HSETNX on 'mili:job:{")
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert acl_redis["admin"].keys("*") == []
