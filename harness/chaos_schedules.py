"""Random fault schedules against the queue protocol, in the spirit of Jepsen: a seeded generator
draws a schedule of submits (with and without request_id, some resubmitted, some streamed, in
each lane, of no tenant or of one of two),
readers that start following a job, cancels, deadlines, workers stalled past claim_idle_ms, killed
without cleanup or drained with SIGTERM semantics, Redis restarts, SCRIPT FLUSH and out-of-memory
windows. Placement is on, as in production (docs/architecture.md): with two workers or more, the
client places jobs on workers' own streams, so a killed, stalled, drained or newly started worker
has jobs placed on it, read or unread, which others reclaim or steal; the steal delay is short
(STEAL_DELAY_MS). Publication coalesces as in production, at intervals short enough that every job's
output goes out in several pieces (STREAM_INTERVAL_S, CHECKPOINT_INTERVAL_S). Several workers (the echo engine, in this
process, each with its own Redis connection) and a client run it against a real redis-server;
then every invariant of the protocol is checked:

  - every job ends exactly once: one final result in its hash, at most one entry in its done
    stream (which lives DONE_TTL_MS after the end), and one end event, their last, where it kept
    its events;
  - a job's token events are contiguous, never repeated, and equal to its expected output
    (its echo, whole or cut short by its cancel or deadline); a job that kept no events (nobody
    streamed it, one run published to it: protocol v2) is its result's;
  - a job moves from one run to the next only when the worker of the earlier run was killed,
    stalled or drained (a worker thread the machine left unscheduled for half of claim_idle_ms
    counts as stalled): a job whose workers all stayed healthy ran once (delivery count 1), and
    nothing is dead-lettered unless its workers really died;
  - once every job has ended, no entry is pending and the queue stream, every lane's stream of
    every tenant and every worker's own stream are empty, no tenant is left active in a lane, and
    every key but the heartbeats, the worker and queue indexes, the lanes' scheduler state and the
    emptied streams expires within result_ttl_s;
  - jobs were placed: a schedule that ran two workers or more at once placed some on their own
    streams (counted in the report, and checked over all schedules by test_schedules.py).

Every fourth schedule (seed % 4 == 3) runs the queue over SHARDS shards (issue 43: producers spread
jobs over them by id, workers read and reclaim every shard); the checks above then cover every
shard's streams, lanes and keys.

A failing schedule raises ScheduleFailed naming its seed: `python -m bench.chaos --seed N
--schedules 1` runs it again. tests/chaos/test_schedules.py runs 100 of them in CI.
"""

from __future__ import annotations

import json
import random
import string
import threading
import time
from dataclasses import dataclass, field

import redis

from harness.echo_workers import GatedWorker, SlowEchoEngine
from harness.polling import eventually
from producer_client import Client
from producer_client.connection import retry_policy
from producer_client.keys import GROUP, LANES, Keys
from producer_client.placement import Placed
from producer_client.protocol import execution
from producer_client.protocol import producer as scripts
from producer_client.schema import JobResult
from worker.loop.queue import connect
from worker.metrics import WorkerMetrics
from worker.settings import WorkerSettings

QUEUE = "chaos"
CLAIM_IDLE_MS = 300
STEP_S = 0.004  # an echo step: a 60-token job runs a quarter of a second
# Coalescing on, at a scale where a job's output goes out in several pieces: a streamed job's
# every few steps, any other's every dozen.
STREAM_INTERVAL_S = 0.02
CHECKPOINT_INTERVAL_S = 0.05
STEAL_DELAY_MS = 100
SETTINGS = dict(
    queue=QUEUE,
    block_ms=20,
    heartbeat_interval_s=0.05,
    heartbeat_ttl_s=2.0,
    claim_idle_ms=CLAIM_IDLE_MS,
    reclaim_interval_s=0.05,
    redis_backoff_max_s=0.1,
    drain_grace_s=0.2,
    max_deliveries=3,
    result_ttl_s=60,
    metrics_port=0,
    engine={"max_running": 4},
    stream_interval_s=STREAM_INTERVAL_S,
    checkpoint_interval_s=CHECKPOINT_INTERVAL_S,
    steal_delay_ms=STEAL_DELAY_MS,
    placement_poll_ms=20,
)
# A worker thread the machine did not run for this long between two exchanges or steps has
# stalled as surely as one stopped on purpose (a loaded 2-core machine does that): its jobs may
# move, and the check counts it as troubled.
STARVED_S = CLAIM_IDLE_MS / 1000 / 2
SETTLE_TIMEOUT_S = 60.0
# What a submit draws its tenant and lane from: a quarter of the jobs go to the queue's own stream
# (the default lane's of no tenant, as a producer that knows no lanes), the others to the lanes'
# streams of no tenant or of one of two.
TENANTS = (None, None, "ta", "tb")
TIERS = (None, None, "priority", "flex")
SHARDS = 3  # a sharded schedule's shards (decided by its seed, not drawn: earlier seeds keep their schedules)


def shards_of(seed: int) -> int:
    return SHARDS if seed % 4 == 3 else 1


class ScheduleFailed(AssertionError):
    pass


class ScheduleWorker(GatedWorker):
    """A GatedWorker that also notes when the machine left its thread unscheduled."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.starved = False
        self.passed_at = time.monotonic()

    def pass_gate(self) -> None:
        if time.monotonic() - self.passed_at > STARVED_S:
            self.starved = True
        super().pass_gate()
        self.passed_at = time.monotonic()


@dataclass
class Submitted:
    job_id: str
    prompt: str
    max_tokens: int
    cancelled: bool = False

    @property
    def expected(self) -> list[int]:
        return list(self.prompt.encode()[: self.max_tokens])


@dataclass
class Run:
    """One schedule's world: its workers, client, jobs, and which workers were troubled."""

    seed: int
    url: str
    prefix: str
    rng: random.Random
    workers: list[ScheduleWorker] = field(default_factory=list)
    jobs: dict[str, Submitted] = field(default_factory=dict)
    troubled: set[str] = field(default_factory=set)  # killed, stalled or drained
    timers: list[threading.Timer] = field(default_factory=list)
    ops: list[str] = field(default_factory=list)
    shards: int = 1  # the queue's
    spawned: int = 0
    laned: int = 0  # jobs submitted with a tenant or to a lane other than default

    def fail(self, message: str) -> ScheduleFailed:
        return ScheduleFailed(f"schedule seed={self.seed}: {message}\nops: {', '.join(self.ops)}")


def start_worker(run: Run) -> ScheduleWorker:
    name = f"{run.prefix}-w{run.spawned}"
    run.spawned += 1
    # Unsharded, a worker names no count (it reads the stored one: none, so 1), as the schedules
    # before sharding ran; sharded, each names it, as `--queue-shards 3` does.
    shards = run.shards if run.shards > 1 else None
    settings = WorkerSettings.load(None, redis=run.url, prefix=run.prefix, name=name, queue_shards=shards, **SETTINGS)
    engine = SlowEchoEngine(settings.engine, STEP_S)
    worker = ScheduleWorker(engine, connect(run.url), settings, WorkerMetrics(), name)
    run.workers.append(worker.start())
    return worker


def live_workers(run: Run) -> list[ScheduleWorker]:
    return [w for w in run.workers if not w.killed and w.drain_deadline is None]


# -- the operations a schedule draws from ----------------------------------------------------------


def op_submit(run: Run, client: Client, admin: redis.Redis) -> str:
    prompt = "".join(run.rng.choice(string.ascii_letters) for _ in range(run.rng.randint(5, 80)))
    max_tokens = run.rng.randint(1, 100)
    timeout_s = run.rng.choice([None] * 6 + [run.rng.uniform(0.05, 1.5)])
    request_id = run.rng.choice([None, f"rid-{run.rng.randrange(10**9)}"])
    tenant, tier = run.rng.choice(TENANTS), run.rng.choice(TIERS)
    kwargs = dict(max_tokens=max_tokens, timeout_s=timeout_s, request_id=request_id, stream=run.rng.random() < 0.3)
    submitter = client.as_tenant(tenant)
    try:
        job_id = submitter.submit(prompt, service_tier=tier, **kwargs)
        if request_id is not None and run.rng.random() < 0.3:
            # a retried submit: the same job, enqueued once
            assert submitter.submit(prompt, service_tier=tier, **kwargs) == job_id
    except (redis.RedisError, OSError) as e:  # refused (memory full): not acknowledged, not counted
        return f"submit refused ({type(e).__name__})"
    run.jobs[job_id] = Submitted(job_id, prompt, max_tokens)
    run.laned += tenant is not None or tier is not None
    return f"submit {job_id[:8]}"


def op_cancel(run: Run, client: Client, admin: redis.Redis) -> str:
    if not run.jobs:
        return "cancel (none)"
    job = run.rng.choice(list(run.jobs.values()))
    try:
        client.cancel(job.job_id)
    except (redis.RedisError, OSError) as e:
        return f"cancel refused ({type(e).__name__})"
    job.cancelled = True
    return f"cancel {job.job_id[:8]}"


def op_follow(run: Run, client: Client, admin: redis.Redis) -> str:
    """A reader starts following a job (as stream() does first): its worker streams it from then on."""
    if not run.jobs:
        return "follow (none)"
    job = run.rng.choice(list(run.jobs.values()))
    follow = scripts.follow(client.keys, job.job_id)
    try:
        execution.execute(client.redis, follow.add_to)
    except (redis.RedisError, OSError) as e:
        return f"follow refused ({type(e).__name__})"
    return f"follow {job.job_id[:8]}"


def op_stall(run: Run, client: Client, admin: redis.Redis) -> str:
    worker = pick_worker(run)
    if worker is None:
        return "stall (none)"
    run.troubled.add(worker.name)
    worker.gate.clear()
    stall_s = run.rng.uniform(1.2, 3.0) * CLAIM_IDLE_MS / 1000
    later(run, stall_s, worker.gate.set)
    return f"stall {worker.name} {stall_s:.2f}s"


def op_kill(run: Run, client: Client, admin: redis.Redis) -> str:
    worker = pick_worker(run)
    if worker is None:
        return "kill (none)"
    run.troubled.add(worker.name)
    worker.killed = True
    worker.gate.clear()
    start_worker(run)
    return f"kill {worker.name}"


def op_drain(run: Run, client: Client, admin: redis.Redis) -> str:
    worker = pick_worker(run)
    if worker is None:
        return "drain (none)"
    run.troubled.add(worker.name)
    worker.request_stop()
    start_worker(run)
    return f"drain {worker.name}"


def op_start(run: Run, client: Client, admin: redis.Redis) -> str:
    return f"start {start_worker(run).name}"


def op_script_flush(run: Run, client: Client, admin: redis.Redis) -> str:
    admin.script_flush()
    return "script flush"


def op_memory_full(run: Run, client: Client, admin: redis.Redis) -> str:
    window_s = run.rng.uniform(0.05, 0.4)
    admin.config_set("maxmemory", 1)
    later(run, window_s, lambda: admin.config_set("maxmemory", 0))
    return f"memory full {window_s:.2f}s"


def op_sleep(run: Run, client: Client, admin: redis.Redis) -> str:
    pause_s = run.rng.uniform(0.01, 0.15)
    time.sleep(pause_s)
    return f"sleep {pause_s:.2f}s"


# Weights: mostly traffic and pauses, faults now and then. A Redis restart is rarer (the
# runner does it: it owns the server).
OPS = [
    (op_submit, 30),
    (op_sleep, 20),
    (op_cancel, 4),
    (op_follow, 3),
    (op_stall, 4),
    (op_kill, 3),
    (op_drain, 2),
    (op_start, 2),
    (op_script_flush, 2),
    (op_memory_full, 2),
]
RESTART_WEIGHT = 1


def pick_worker(run: Run) -> ScheduleWorker | None:
    candidates = [w for w in live_workers(run) if w.gate.is_set()]
    return run.rng.choice(candidates) if candidates else None


def later(run: Run, delay_s: float, action) -> None:
    timer = threading.Timer(delay_s, action)
    run.timers.append(timer)
    timer.start()


# -- running a schedule --------------------------------------------------------------------------


def run_schedule(seed: int, server, length: int = 24) -> dict:
    """Draw schedule `seed`, run it against `server` (a RestartableRedis), check the invariants.
    Returns counts for the report; raises ScheduleFailed naming the seed."""
    rng = random.Random(seed)
    run = Run(seed, server.url, f"chaos{seed}", rng, shards=shards_of(seed))
    # Retried like the clients' calls: a memory window may end while Redis restarts.
    admin = redis.Redis.from_url(server.url, decode_responses=True, retry=retry_policy())
    client = Client(server.url, QUEUE, prefix=run.prefix, queue_shards=run.shards)
    try:
        for _ in range(rng.randint(1, 3)):
            start_worker(run)
        choices = [op for op, _ in OPS] + [None]
        weights = [weight for _, weight in OPS] + [RESTART_WEIGHT]
        for _ in range(length):
            op = rng.choices(choices, weights=weights)[0]
            if op is None:
                down_s = rng.uniform(0.05, 0.3)
                server.restart(down_s=down_s)
                run.ops.append(f"redis restart {down_s:.2f}s")
            else:
                run.ops.append(op(run, client, admin))
        for timer in run.timers:
            timer.join()
        if not [w for w in live_workers(run) if w.gate.is_set()]:
            start_worker(run)
        results = settle(run, admin)
        starved = {w.name for w in run.workers if w.starved}
        run.troubled |= starved
        check(run, admin, results)
        placed = client.placement.placed[Placed.AFFINITY]
        return {
            "jobs": len(run.jobs),
            "faults": len(run.troubled),
            "ops": len(run.ops),
            "starved": len(starved),
            "placed": placed,
            "stolen": taken(run, "stolen"),
            "reclaimed": taken(run, "reclaimed"),
            "laned": run.laned,
            "sharded": int(run.shards > 1),
        }
    finally:
        for timer in run.timers:
            timer.cancel()
        admin.config_set("maxmemory", 0)
        stop_workers(run)
        client.close()
        admin.close()


def settle(run: Run, admin: redis.Redis) -> dict[str, JobResult]:
    """Wait until every job has its final result."""
    keys = Keys(run.prefix)
    results: dict[str, JobResult] = {}

    def all_ended() -> bool:
        for job_id in run.jobs:
            if job_id not in results and (raw := admin.hget(keys.job(job_id), "result")) is not None:
                results[job_id] = JobResult.model_validate_json(raw)
        return len(results) == len(run.jobs)

    if not eventually(all_ended, SETTLE_TIMEOUT_S, interval=0.02):
        missing = [j for j in run.jobs if j not in results]
        states = {j[:8]: admin.hgetall(keys.job(j)) for j in missing[:5]}
        raise run.fail(f"{len(missing)} jobs never ended within {SETTLE_TIMEOUT_S:g}s: {states}")
    return results


def check(run: Run, admin: redis.Redis, results: dict[str, JobResult]) -> None:
    keys = Keys(run.prefix)
    for job_id, job in run.jobs.items():
        check_job(run, admin, keys, job, results[job_id])
    check_queue_drained(run, admin, keys)
    check_lanes_left(run, admin, keys)
    check_keys_expire(run, admin, keys)


def check_job(run: Run, admin: redis.Redis, keys: Keys, job: Submitted, result: JobResult) -> None:
    events = [(f["type"], json.loads(f["data"])) for _, f in admin.xrange(keys.events(job.job_id))]
    ends = [kind for kind, _ in events].count("end")
    kept = bool(events)
    if (kept and (ends != 1 or events[-1][0] != "end")) or admin.xlen(keys.done(job.job_id)) > 1:
        raise run.fail(f"job {job.job_id}: {ends} end events, {admin.xlen(keys.done(job.job_id))} done entries")
    if not kept and result.timings.started_at is not None:
        # It kept no events: one run published to it, whose whole output its result holds.
        events = [("start", {"worker": result.worker}), ("tokens", {"ids": result.token_ids}), ("end", {})]
    published = [t for kind, data in events if kind == "tokens" for t in data["ids"]]
    if published != result.token_ids or result.token_ids != job.expected[: len(result.token_ids)]:
        raise run.fail(f"job {job.job_id}: published {published}, result {result.token_ids}, expected {job.expected}")
    whole = result.status == "done" and result.finish_reason in ("length", "stop")
    if whole and result.token_ids != job.expected:
        raise run.fail(f"job {job.job_id}: done ({result.finish_reason}) with {result.token_ids}, not {job.expected}")
    allowed = {"done", "expired"} | ({"cancelled"} if job.cancelled else set())
    if result.status == "failed" or result.status not in allowed:
        dead = result.error is not None and result.error.code == "poison"
        if not dead:
            raise run.fail(f"job {job.job_id}: ended {result.status} {result.error}")
    runs = [data["worker"] for kind, data in events if kind == "start"]
    movers = set(runs[:-1]) if result.status != "failed" else set(runs)
    if not movers <= run.troubled:
        raise run.fail(f"job {job.job_id} moved from healthy workers: runs {runs}, troubled {sorted(run.troubled)}")


def check_queue_drained(run: Run, admin: redis.Redis, keys: Keys) -> None:
    for stream in streams_of(run, keys, admin):

        def drained(stream=stream) -> bool:
            return not admin.xlen(stream) and not pending(admin, stream)

        if not eventually(drained, 10, interval=0.02):
            raise run.fail(
                f"stream {stream} not drained: {admin.xlen(stream)} entries, {pending(admin, stream)} pending"
            )


def check_lanes_left(run: Run, admin: redis.Redis, keys: Keys) -> None:
    """Every tenant has left its lane: READ read each stream to its end."""
    lanes = [keys.lane(shard, lane) for shard in shard_names(run) for lane in LANES]

    def idle() -> bool:
        return not any(admin.zcard(lane) for lane in lanes)

    if not eventually(idle, 10, interval=0.02):
        raise run.fail(f"tenants left active in the lanes: {[admin.zrange(lane, 0, -1) for lane in lanes]}")


def streams_of(run: Run, keys: Keys, admin: redis.Redis) -> list[str]:
    """Each shard's stream and its every lane's stream of every tenant, and every worker's own."""
    streams = []
    for shard in shard_names(run):
        members = admin.smembers(keys.lane_streams(shard))
        streams += [keys.queue(shard), *(keys.lane_stream(shard, *member.split(":", 1)) for member in members)]
    return streams + [keys.own_queue(QUEUE, w.name) for w in run.workers]


def shard_names(run: Run) -> list[str]:
    return [Keys.shard(QUEUE, i) for i in range(run.shards)]


def pending(admin: redis.Redis, stream: str) -> int:
    """Entries pending in the stream's group; none without a group (a stream nobody read)."""
    try:
        return admin.xpending(stream, GROUP)["pending"]
    except redis.ResponseError:
        return 0


def taken(run: Run, source: str) -> int:
    return int(sum(w.metrics.taken[source]._value.get() for w in run.workers))


def check_keys_expire(run: Run, admin: redis.Redis, keys: Keys) -> None:
    """Everything but the heartbeats, the indexes, the queue and dead-letter streams goes within
    result_ttl_s: each job key carries a TTL no longer than that."""
    staying = {*streams_of(run, keys, admin), keys.workers(QUEUE), keys.queues()}
    for shard in shard_names(run):
        # The lanes' state outlives the jobs: idle tenants' counters, the set of lane streams, the doorbell.
        staying |= {keys.dead(shard), keys.scheduler(shard), keys.lane_streams(shard), keys.doorbell(shard)}
    heartbeats = f"{run.prefix}:worker:"
    longest_ms = 1000 * SETTINGS["result_ttl_s"]
    for key in admin.scan_iter(match=f"{run.prefix}:*", count=1000):
        if key in staying or key.startswith(heartbeats):
            continue
        # PTTL, not TTL: TTL rounds to whole seconds, and a done stream in the last half second of
        # its DONE_TTL_MS read 0, as a key that never expires would fail (seed 6279's "TTL 0").
        ttl_ms = admin.pttl(key)
        if ttl_ms == -2:
            continue  # it expired between the scan and the read
        if not 0 < ttl_ms <= longest_ms:
            raise run.fail(f"key {key} stays: PTTL {ttl_ms} ms")


def stop_workers(run: Run) -> None:
    for worker in run.workers:
        worker.gate.set()  # a killed worker's thread ends at its gate (its heartbeat is long gone)
        if not worker.killed:
            worker.request_stop()
            worker.request_stop()
    for worker in run.workers:
        worker.wait_stopped(timeout=30)
