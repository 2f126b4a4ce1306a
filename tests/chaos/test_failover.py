"""Redis itself failing over under a running queue, in its two distributed modes: the master that
holds a queue's stream is killed with kill -9 while two echo workers run 20 jobs that a producer
is still submitting and a consumer is waiting for, and its replica is promoted: by the cluster
(cluster-node-timeout) or by the sentinels (down-after-milliseconds); then the killed node comes
back as a replica, as a replaced machine does. On a cluster, the queue's slot is also moved to
another master mid-run (`redis-cli --cluster reshard`), which the workers and clients follow
through MOVED and ASK.

Replication is asynchronous: a write a master acknowledged and died before its replica had is
lost. With wait_replicas (client and workers), every acknowledged submit and every acknowledged
result is on a replica first, so no job a submit acknowledged may be lost: the tests assert it.
Without it they count what was lost and print the count (on one machine's loopback the replica
is rarely behind, so it is usually 0, but nothing promises it). Every job that was not lost ends
with exactly one result, and no entry is left in the queue. The jobs go through every lane and
two tenants as well as the queue's own stream (ROUTES): a lane's stream of a tenant lives in the
queue's slot, and fails over with it."""

from __future__ import annotations

import subprocess
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis
from redis.crc import key_slot

from harness.polling import eventually
from harness.redis_servers import LocalCluster, LocalSentinel
from producer_client import Client
from producer_client.errors import JobNotFound, JobTimeout, MiliError
from producer_client.keys import GROUP, Keys
from producer_client.schema import JobResult
from tests.support.jobs import assert_one_final_result, has_ended
from tests.support.workers import echo_workers

pytestmark = pytest.mark.waits

KEYS = Keys()
JOBS = 20
PROMPT_BYTES = 600  # the echo engine answers a prompt a byte a step: each job takes a while
SUBMIT_GAP_S = 0.05  # the producer is still submitting when Redis fails over
# Redis notices a dead master after this long (cluster-node-timeout, down-after-milliseconds);
# the promotion then takes a second or two more. Each test runs for several times this.
FAILURE_DETECTION_MS = 1000
WAIT_TIMEOUT_MS = 200
# Fast recovery, and room for a WAIT in claim_idle_ms (WorkerSettings checks it).
WORKER_FLAGS = ("--claim-idle-ms", "1000", "--reclaim-interval-s", "0.2", "--max-running", "4")
DRAIN_TIMEOUT_S = 120
# (tenant, service_tier) of job i: ROUTES[i % len(ROUTES)]. The first is the queue's own stream
# (no tenant, default lane); the others each lane of two tenants.
ROUTES = (
    (None, None),
    ("team-a", "priority"),
    ("team-b", "flex"),
    ("team-a", "default"),
    ("team-b", "priority"),
    ("team-a", "flex"),
    ("team-b", "default"),
)


def lane_streams(queue: str) -> list[str]:
    """Every stream ROUTES puts jobs in."""
    return [KEYS.lane_stream(queue, tier or "default", tenant or "-") for tenant, tier in ROUTES]


@dataclass
class Producer:
    """Submits JOBS jobs, one every SUBMIT_GAP_S, through whatever Redis is doing meanwhile, each
    with a request_id, so that a job whose submit raised can be looked up too: it was not
    acknowledged, but may exist (NotReplicated: it does). Job i goes by ROUTES[i % len(ROUTES)]."""

    client: Client
    queue: str
    acknowledged: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # job id -> the error's code or class
    done: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        try:
            for i in range(JOBS):
                self.submit(f"{self.queue}-{i}", f"{i:04d} " + "x" * (PROMPT_BYTES - 5), *ROUTES[i % len(ROUTES)])
                time.sleep(SUBMIT_GAP_S)
        finally:
            self.done.set()

    def submit(self, job_id: str, prompt: str, tenant: str | None, tier: str | None) -> None:
        client = self.client.as_tenant(tenant)
        try:
            self.acknowledged.append(
                client.submit(prompt, max_tokens=PROMPT_BYTES, request_id=job_id, service_tier=tier)
            )
        except MiliError as e:
            self.refused[job_id] = e.code
        except redis.RedisError as e:
            self.refused[job_id] = type(e).__name__

    def acknowledged_so_far(self) -> Iterator[str]:
        """The acknowledged jobs in order, as they come, until the producer is done."""
        at = 0
        while not (self.done.is_set() and at == len(self.acknowledged)):
            if at < len(self.acknowledged):
                yield self.acknowledged[at]
                at += 1
            else:
                time.sleep(0.01)


@dataclass
class Consumer:
    """Waits for each acknowledged job's result in turn, in blocking reads that span the failover.
    A lost job never ends: it is passed over once the test has found it lost."""

    client: Client
    producer: Producer
    results: dict[str, JobResult] = field(default_factory=dict)
    lost: set[str] = field(default_factory=set)
    error: BaseException | None = None

    def run(self) -> None:
        try:
            for job_id in self.producer.acknowledged_so_far():
                while job_id not in self.results and job_id not in self.lost:
                    self.read(job_id)
        except BaseException as e:  # the test fails with it
            self.error = e

    def read(self, job_id: str) -> None:
        try:
            self.results[job_id] = self.client.result(job_id, timeout=0.5)
        except JobTimeout:
            pass
        except JobNotFound:  # its hash was lost: a worker that claims its entry writes it again
            time.sleep(0.1)


@dataclass
class Outcome:
    acknowledged: list[str]
    refused: dict[str, str]
    lost: list[str]  # acknowledged, and no result once the queue is empty

    def report(self, what: str) -> str:
        refused = ", ".join(sorted(set(self.refused.values()))) or "none"
        return (
            f"\n{what}: {len(self.acknowledged)} of {JOBS} submits acknowledged ({len(self.refused)} refused: "
            f"{refused}); {len(self.lost)} acknowledged jobs lost"
        )


def run_through(url: str, queue: str, wait_replicas: int, fault: Callable[[], None], admin, log_dir) -> Outcome:
    """Two echo workers, a producer and a consumer of `queue`; `fault()` once the workers are
    running jobs and half of them are submitted; then on until the queue is empty. Checks that
    every job with a result has one only, and that the consumer read every acknowledged job's
    result but the lost ones'."""
    wait = {"wait_replicas": wait_replicas, "wait_timeout_ms": WAIT_TIMEOUT_MS}
    flags = (*WORKER_FLAGS, "--wait-replicas", str(wait_replicas), "--wait-timeout-ms", str(WAIT_TIMEOUT_MS))
    with (
        echo_workers(url, queue, log_dir, *flags) as workers,
        Client(url, queue, **wait) as producing,
        Client(url, queue) as consuming,
    ):
        producer = Producer(producing, queue)
        consumer = Consumer(consuming, producer)
        threads = [threading.Thread(target=producer.run), threading.Thread(target=consumer.run)]
        for thread in threads:
            thread.start()
        try:
            half_way = lambda: len(producer.acknowledged) >= JOBS // 2 and running(admin, producer.acknowledged) >= 2  # noqa: E731
            assert eventually(half_way, timeout=60)
            fault()
            assert producer.done.wait(timeout=DRAIN_TIMEOUT_S)
            # Every stream of the queue: the shared one, the lanes' and, with placement, each worker's own.
            streams = [*lane_streams(queue), *(KEYS.own_queue(queue, w.name) for w in workers)]
            drained = eventually(lambda: all(admin.xlen(s) == 0 for s in streams), timeout=DRAIN_TIMEOUT_S)
            assert drained, "\n".join(w.log()[-3000:] for w in workers)
            assert [pending(admin, s) for s in streams] == [0] * len(streams)
            consumer.lost.update(job_id for job_id in producer.acknowledged if not has_ended(admin, job_id))
        finally:
            for thread in threads:
                thread.join(timeout=60)
    assert consumer.error is None, "".join(traceback.format_exception(consumer.error))
    assert not any(thread.is_alive() for thread in threads)
    for job_id in [*producer.acknowledged, *producer.refused]:
        if has_ended(admin, job_id):
            assert_one_final_result(admin, job_id)
    assert sorted(consumer.results) == sorted(set(producer.acknowledged) - consumer.lost)
    for job_id, result in consumer.results.items():
        assert (result.status, result.finish_reason, result.usage.completion_tokens) == (
            "done",
            "length",
            PROMPT_BYTES,
        ), job_id
    served = {ROUTES[int(job_id.rsplit("-", 1)[1]) % len(ROUTES)] for job_id in consumer.results}
    assert served == set(ROUTES)  # results read in every lane of both tenants and the queue's own stream
    return Outcome(producer.acknowledged, producer.refused, sorted(consumer.lost))


def pending(admin, stream: str) -> int:
    """Entries pending in the stream's group; none for a stream nobody read (no group)."""
    try:
        return admin.xpending(stream, GROUP)["pending"]
    except redis.ResponseError:
        return 0


def running(admin, job_ids: list[str]) -> int:
    return sum(admin.hget(KEYS.job(job_id), "status") == "running" for job_id in list(job_ids))


@pytest.fixture
def cluster(tmp_path):
    with LocalCluster(tmp_path / "cluster", node_timeout_ms=FAILURE_DETECTION_MS) as nodes:
        yield nodes


@pytest.fixture
def sentinel(tmp_path):
    with LocalSentinel(tmp_path / "sentinel", down_after_ms=FAILURE_DETECTION_MS) as setup:
        yield setup


@pytest.mark.parametrize("wait_replicas", [0, 1])
@pytest.mark.parametrize("mode", ["cluster", "sentinel"])
def test_a_failover_of_the_queues_master_loses_no_acknowledged_job_with_wait(
    mode, wait_replicas, request, tmp_path, capsys
):
    deployment = request.getfixturevalue(mode)
    queue = f"failover-{uuid.uuid4().hex[:6]}"
    with deployment.admin() as admin:
        outcome = run_through(
            deployment.url, queue, wait_replicas, lambda: deployment.fail_over(KEYS.queue(queue)), admin, tmp_path
        )
    with capsys.disabled():
        print(outcome.report(f"{mode} failover, wait_replicas={wait_replicas}"))
    if wait_replicas:
        assert outcome.lost == []


def test_resharding_the_queues_slot_mid_run_loses_nothing(cluster, tmp_path):
    """The queue's slot is the first of its master's, so that moving that master's first slots
    (`reshard` takes a source's lowest slots first) moves it, with the jobs in the others."""
    source = cluster.nodes[0]
    first_slot = min(cluster.slots_of(source))
    queue = next(
        q for q in (f"reshard-{n}" for n in range(1_000_000)) if key_slot(KEYS.queue(q).encode()) == first_slot
    )
    target = next(n for n in cluster.nodes[1:3] if cluster.slots_of(n))

    def reshard() -> None:
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "reshard",
                source.address,
                "--cluster-from",
                cluster.node_id(source),
                "--cluster-to",
                cluster.node_id(target),
                "--cluster-slots",
                "2000",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cluster.master_of(KEYS.queue(queue)) is target

    with cluster.admin() as admin:
        outcome = run_through(cluster.url, queue, 0, reshard, admin, tmp_path)
    assert (outcome.lost, outcome.refused, len(outcome.acknowledged)) == ([], {}, JOBS)
