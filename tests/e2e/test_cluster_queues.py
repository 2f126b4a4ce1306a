"""Several queues on a Redis Cluster, each on a shard of its own (a queue's keys share its hash
tag, so one queue lives on one shard and load spreads over shards by queue), with an echo
worker each: `mili stats --all`, `mili workers` and the clients see every queue and every
heartbeat; bulk submission, as_completed and the Batch API, whose jobs' keys lie on every shard,
work as on one server; and docs/security.md's ACL users, with the rights docs/operations.md adds on
a cluster."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import uuid

import openai
import pytest

from harness.polling import eventually
from harness.processes import REPO
from producer_client import AsyncClient, Client, JobNotFound
from producer_client.errors import PermissionDenied
from producer_client.keys import Keys
from tests.support.acl import PASSWORDS, acl_commands
from tests.support.clients import SyncView
from tests.support.gateways import GatewayProcess
from tests.support.workers import WorkerProcess, start_workers

KEYS = Keys()
MODEL = "cluster-echo"
OPERATIONS_DOC = REPO / "docs" / "operations.md"


@pytest.fixture(scope="module")
def queues(redis_cluster) -> list[str]:
    """Three queue names whose keys lie on the three masters, one each."""
    by_master = {}
    run = uuid.uuid4().hex[:6]
    for n in range(1000):
        queue = f"shard-{run}-{n}"
        by_master.setdefault(redis_cluster.master_of(KEYS.queue(queue)).port, queue)
        if len(by_master) == 3:
            return list(by_master.values())
    raise AssertionError("no three queues on three masters")


@pytest.fixture(scope="module")
def workers(redis_cluster, queues, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("cluster-workers")
    procs = [WorkerProcess(redis_cluster.url, queue, f"{queue}-w", log_dir, model="echo") for queue in queues]
    try:
        yield start_workers(procs)
    finally:
        for w in procs:
            w.stop()


def mili(url: str, queue: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cli", "--redis", url, "--queue", queue, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_every_queue_on_every_shard_has_its_stats_and_its_live_worker(redis_cluster, queues, workers):
    with Client(redis_cluster.url, queues[0]) as client:
        for queue in queues:
            on = client.on_queue(queue)
            ids = [on.submit(f"{queue} job {i}", max_tokens=8) for i in range(3)]
            assert [on.result(job_id, timeout=60).text for job_id in ids] == [f"{queue} job {i}"[:8] for i in range(3)]
        assert set(queues) <= set(client.inspect.queues())
        assert {(w.name, w.queue) for w in client.workers()} >= {(w.name, w.queue) for w in workers}
    stats = {s["queue"]: s for s in json.loads(mili(redis_cluster.url, queues[0], "stats", "--all"))}
    for queue, worker in zip(queues, workers):
        assert (stats[queue]["depth"], stats[queue]["pending"], stats[queue]["workers"]) == (0, 0, [worker.name])
    listed = mili(redis_cluster.url, queues[0], "workers")
    assert all(w.name in listed for w in workers)
    with redis_cluster.admin() as admin:
        assert all(admin.exists(KEYS.worker(w.name)) for w in workers)  # heartbeats, on their own shards


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_bulk_submission_and_as_completed_span_every_shard(redis_cluster, queues, workers, kind):
    queue = queues[1]
    client = Client(redis_cluster.url, queue) if kind == "sync" else SyncView(AsyncClient(redis_cluster.url, queue))
    try:
        specs = [{"prompt": f"bulk {i:03d}", "max_tokens": 8} for i in range(60)]
        specs += [{"prompt": "keyed", "max_tokens": 8, "request_id": f"keyed-{uuid.uuid4().hex}"}]
        ids = client.submit_many(specs)
        with redis_cluster.admin() as admin:
            assert len({admin.get_node_from_key(KEYS.job(job_id)).name for job_id in ids}) == 3  # every shard
        ended = list(client.as_completed(ids, timeout=60))
        assert sorted(r.id for r in ended) == sorted(ids)
        assert {r.id: r.text for r in ended} == dict(zip(ids, [s["prompt"][:8] for s in specs]))
        client.cancel_many(ids)  # they have ended: nothing changes
        assert [r.status for r in client.results(ids, timeout=10)] == ["done"] * len(ids)
        with pytest.raises(JobNotFound):
            list(client.as_completed([ids[0], "no-such-job", "nor-this-one"], timeout=5))
    finally:
        client.close()


def test_the_batch_api_runs_a_batch_on_a_cluster(redis_cluster, queues, workers, tmp_path):
    gateway = GatewayProcess(
        redis_cluster.url,
        tmp_path,
        "--models",
        json.dumps({MODEL: queues[2]}),
        "--batch-poll-s",
        "0.1",
        "--batch-lease-s",
        "1",
    ).start()
    try:
        sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
        lines = [
            {
                "custom_id": f"c{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": f"line {i:02d}", "max_tokens": 7},
            }
            for i in range(40)
        ]
        text = "".join(json.dumps(line) + "\n" for line in lines)
        upload = sdk.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch")
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
        ended = ("completed", "failed", "expired", "cancelled")
        assert eventually(lambda: sdk.batches.retrieve(batch.id).status in ended, 120, interval=0.1), gateway.log()[
            -3000:
        ]
        batch = sdk.batches.retrieve(batch.id)
        assert (batch.status, batch.request_counts.completed, batch.request_counts.failed) == ("completed", 40, 0)
        answers = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
        texts = {a["custom_id"]: a["response"]["body"]["choices"][0]["text"] for a in answers}
        assert texts == {f"c{i}": f"line {i:02d}"[:7] for i in range(40)}
    finally:
        gateway.stop()


def cluster_rights() -> list[str]:
    """What docs/operations.md says the ACL users need besides their rights on a cluster."""
    said = re.search(
        r"also need `([^`]+)`, with which redis-py reads the topology", " ".join(OPERATIONS_DOC.read_text().split())
    )
    assert said, "docs/operations.md names no cluster rights for the ACL users"
    return said[1].split()


def test_the_acl_users_run_on_a_cluster_with_the_rights_operations_md_adds(redis_cluster, tmp_path):
    """docs/security.md's users, each with the cluster rights docs/operations.md adds, on every
    node (a cluster's ACL is each node's own): an echo worker as the workers' user serves a queue of
    its own, and the producers' and gateways' users submit, generate, bulk-submit and read
    as_completed, stream, stat the queue and list the workers there, and run `mili stats --all`."""
    for node in redis_cluster.live():
        with node.client() as admin:
            for command in acl_commands():
                admin.execute_command(*command)
                admin.execute_command("ACL", "SETUSER", command[2], *cluster_rights())
    nodes = redis_cluster.url.removeprefix("redis+cluster://")
    url = {
        role: f"redis+cluster://mili-{role}:{PASSWORDS[f'{role.upper()}_PASSWORD']}@{nodes}"
        for role in ("worker", "producer", "gateway")
    }
    queue = f"acl-{uuid.uuid4().hex[:8]}"
    worker = WorkerProcess(url["worker"], queue, f"{queue}-w", tmp_path, model="echo")
    try:
        worker.start().wait_ready()
        for role in ("producer", "gateway"):
            with Client(url[role], queue) as client:
                assert client.generate(prompt="here", max_tokens=4, timeout=60).text == "here", role
                ids = client.submit_many([{"prompt": p, "max_tokens": 1} for p in "ab"])
                assert sorted(r.text for r in client.as_completed(ids, timeout=60)) == ["a", "b"], role
                streamed = client.submit(prompt="stream", max_tokens=4, stream=True)
                assert "".join(d.text for d in client.stream(streamed)) == "stre", role
                assert client.queue_stats().workers == [f"{queue}-w"], role
                assert f"{queue}-w" in [w.name for w in client.workers()], role
            assert queue in [q["queue"] for q in json.loads(mili(url[role], queue, "stats", "--all"))], role
    finally:
        worker.stop()


def test_a_user_without_the_cluster_rights_is_told_the_right_it_lacks_not_that_the_cluster_is_none(redis_cluster):
    """docs/security.md's producer user as it is, without the rights docs/operations.md adds on a
    cluster: redis-py reads a NOPERM to its CLUSTER SLOTS as a node with cluster mode off, and the
    client, the CLI and a worker said 'Cluster mode is not enabled on this node: for one server,
    use a redis:// URL', sending the operator away from the ACL. Now redis_refused, naming the
    command the user may not run."""
    (producer,) = [c for c in acl_commands() if c[2] == "mili-producer"]
    user = f"mili-nocluster-{uuid.uuid4().hex[:6]}"
    for node in redis_cluster.live():
        with node.client() as admin:
            admin.execute_command("ACL", "SETUSER", user, *producer[3:])
    url = redis_cluster.url.replace("redis+cluster://", f"redis+cluster://{user}:{PASSWORDS['PRODUCER_PASSWORD']}@")
    with pytest.raises(PermissionDenied, match=re.escape("'cluster|slots'")):
        Client(url).submit(prompt="a")
    done = subprocess.run(
        [sys.executable, "-m", "cli", "--redis", url, "stats"], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error: redis_refused: Redis refused ") and "'cluster|slots'" in done.stderr
    assert "Cluster mode is not enabled" not in done.stderr and PASSWORDS["PRODUCER_PASSWORD"] not in done.stderr
