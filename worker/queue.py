"""The worker's side of protocol v1: every Redis command the queue loop sends, batched so that
one loop iteration costs a few round trips (read, claim, publish), and the outbox that holds
what Redis has not seen yet while it cannot be reached, with the backoff for reaching it again."""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from producer_client import scripts
from producer_client.keys import GROUP, Keys
from producer_client.protocol import job_keys
from producer_client.schema import JobResult, TokenLogprob
from producer_client.scripts import CLAIM, DEADLETTER, PUBLISH, RECLAIM, REFRESH, RELEASE
from worker.jobs import Delivery, Job, token_event

log = logging.getLogger(__name__)

# Names of workers whose heartbeat is this stale are dropped from the queue's worker index.
WORKER_INDEX_RETENTION_S = 3600
# The dead-letter stream keeps about this many entries (XADD MAXLEN ~): bounded memory, and far
# more than an operator reads before acting on the alert.
DEAD_LETTER_MAXLEN = 10_000
EVENT_PAGE = 1000  # event stream entries per XRANGE when a reclaimed job's events are read
# Replies that mean "not now" rather than "never": the loop backs off and sends the same
# (idempotent) commands again. Loading an AOF, a replica promoted by failover, memory full
# under noeviction, a failing RDB save, a cluster resharding.
TRANSIENT_REPLIES = frozenset({"LOADING", "READONLY", "MASTERDOWN", "OOM", "MISCONF", "TRYAGAIN", "CLUSTERDOWN", "BUSY"})


def connect(url: str) -> redis.Redis:
    """The worker's connection. surrogateescape: a producer's invalid UTF-8 must fail its job,
    not the read. One immediate retry replaces a connection Redis closed (a restart); past that
    the loop's own backoff takes over, so that the engine keeps stepping while Redis is away."""
    return redis.Redis.from_url(url, decode_responses=True, encoding_errors="surrogateescape", retry=Retry(NoBackoff(), 1))


def is_transient(error: BaseException) -> bool:
    if isinstance(error, (redis.ConnectionError, redis.TimeoutError)):
        return True
    return isinstance(error, redis.ResponseError) and str(error).split(" ", 1)[0] in TRANSIENT_REPLIES


def raise_transient(replies: list) -> list:
    """Replies of a pipeline run with raise_on_error=False: a transient error stands for the whole
    pipeline (raise it); any other error stays in its place, for the caller to charge to its job."""
    for reply in replies:
        if isinstance(reply, Exception) and is_transient(reply):
            raise reply
    return replies


@dataclass
class DeadLetter:
    entry_id: str
    fields: dict[str, str]  # the entry's own: id, v, body
    reason: str
    deliveries: int

    def script_args(self, worker: str) -> list:
        letter = {**self.fields, "entry": self.entry_id, "deliveries": self.deliveries, "reason": self.reason,
                  "worker": worker, "dead_at": time.time()}
        return [GROUP, self.entry_id, DEAD_LETTER_MAXLEN, *(x for kv in letter.items() for x in kv)]


@dataclass
class Update:
    """What one job has to tell Redis and has not yet: the engine steps since its last publication,
    merged into one tokens event (several while Redis is unreachable, else one)."""

    job_id: str
    entry_id: str
    run: str
    tokens_before: int  # tokens of the job that Redis has already
    start: str = ""  # start event JSON: the run's first publication
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    step_sizes: list[int] = field(default_factory=list)  # tokens of each merged step, in order
    final: JobResult | None = None
    # Set for a job that ends in the dead-letter stream: after its final result, its entry moves
    # there instead of being acknowledged.
    dead_letter: DeadLetter | None = None

    def add_tokens(self, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None) -> None:
        self.token_ids.extend(token_ids)
        self.text.append(text)
        self.step_sizes.append(len(token_ids))
        if logprobs is not None:
            self.logprobs = (self.logprobs or []) + logprobs

    def skip_recorded(self, recorded: int) -> bool:
        """Drop the leading steps that Redis already recorded (a publish whose reply was lost
        carried them before more steps merged in). False unless `recorded` ends one of our steps."""
        done = steps = 0
        while steps < len(self.step_sizes) and self.tokens_before + done < recorded:
            done += self.step_sizes[steps]
            steps += 1
        if self.tokens_before + done != recorded:
            return False
        self.token_ids = self.token_ids[done:]
        self.text = self.text[steps:]
        self.step_sizes = self.step_sizes[steps:]
        if self.logprobs is not None:
            self.logprobs = self.logprobs[done:]
        self.tokens_before = recorded
        return True

    def publish_args(self, result_ttl_s: int) -> list:
        # A tokens event without ids (held-back text flushed at the end) only comes with the
        # final result, in the same atomic call: PUBLISH's token count check needs ids to
        # make a repeated call harmless.
        tokens = token_event(self.token_ids, "".join(self.text), self.logprobs) if self.token_ids or any(self.text) else ""
        final = (self.final.status, self.final.model_dump_json()) if self.final else ("", "")
        return [
            self.run, self.start, tokens, self.tokens_before, self.tokens_before + len(self.token_ids), *final,
            result_ttl_s,
        ]


class Outbox:
    """Updates not yet in Redis, one per job. They leave only when a publish has carried them."""

    def __init__(self):
        self.updates: dict[str, Update] = {}

    def __bool__(self) -> bool:
        return bool(self.updates)

    def for_job(self, job: Job) -> Update:
        """The job's pending update; a new one follows the tokens the job has now."""
        update = self.updates.get(job.id)
        if update is None:
            update = self.updates[job.id] = Update(job.id, job.entry_id, job.run, len(job.token_ids))
        return update

    def add(self, update: Update) -> None:
        self.updates[update.job_id] = update

    def discard(self, job_id: str) -> None:
        self.updates.pop(job_id, None)

    def buffered_tokens(self) -> int:
        return sum(len(u.token_ids) for u in self.updates.values())


@dataclass(frozen=True)
class Claimed:
    outcome: str  # 'claimed', 'final', 'duplicate', or 'error' (the job's keys refused the script)
    recorded_tokens: int = 0  # of a claimed job: tokens earlier runs recorded (more than 0: resume it)
    error: Exception | None = None


class WorkerQueue:
    def __init__(self, client: redis.Redis, keys: Keys, queue: str, worker: str, result_ttl_s: int):
        self.redis = client
        self.keys = keys
        self.queue = queue
        self.worker = worker
        self.result_ttl_s = result_ttl_s
        self.stream = keys.queue(queue)
        self.reclaim_cursor = "0-0"

    def ensure_group(self) -> None:
        # From id 0, not $: jobs submitted before the first worker started must run too.
        try:
            self.redis.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def read(
        self, count: int, block_ms: int | None, acks: list[str], dead_letters: list[DeadLetter] = (),
    ) -> list[Delivery]:
        """Acknowledge and delete `acks`, move `dead_letters`, then read up to `count` new entries.
        The acks go first in the same pipeline, so the pending list never holds a finished job
        while new ones arrive: pending entries <= the engine's slots."""
        dead_key = self.keys.dead(self.queue)

        def add(pipe):
            if acks:
                pipe.xack(self.stream, GROUP, *acks)
                pipe.xdel(self.stream, *acks)
            for letter in dead_letters:
                pipe.evalsha(DEADLETTER.sha, 2, self.stream, dead_key, *letter.script_args(self.worker))
            if count > 0:
                pipe.xreadgroup(GROUP, self.worker, {self.stream: ">"}, count=count, block=block_ms)

        if not (acks or dead_letters or count > 0):
            return []
        replies = scripts.execute(self.redis, add)
        if count <= 0 or not replies[-1]:
            return []
        return [Delivery(entry_id, fields) for entry_id, fields in replies[-1][0][1]]

    def reclaim(self, count: int, min_idle_ms: int) -> list[Delivery]:
        """XAUTOCLAIM up to `count` entries idle longer than `min_idle_ms`: jobs of workers that
        died or stalled. The scan resumes where the last one stopped, so every pending entry is
        reached in turn."""
        args = (GROUP, self.worker, min_idle_ms, self.reclaim_cursor, count)
        cursor, claimed = scripts.execute(self.redis, lambda pipe: pipe.evalsha(RECLAIM.sha, 1, self.stream, *args))[0]
        self.reclaim_cursor = cursor
        return [Delivery(entry_id, dict(zip(flat[::2], flat[1::2])), deliveries) for entry_id, flat, deliveries in claimed]

    def claim(self, jobs: list[tuple[str, str, str]]) -> list[Claimed]:
        """CLAIM each (job id, entry id, run token)."""

        def add(pipe):
            for job_id, entry_id, run in jobs:
                pipe.evalsha(CLAIM.sha, 3, *job_keys(self.keys, job_id), self.worker, entry_id, self.result_ttl_s, run)

        replies = raise_transient(scripts.execute(self.redis, add, raise_on_error=False))
        return [
            Claimed("error", error=r) if isinstance(r, Exception) else Claimed(r[0], int(r[1]) if len(r) > 1 else 0)
            for r in replies
        ]

    def recorded_events(self, job_ids: list[str]) -> dict[str, list[tuple[str, dict[str, str]]]]:
        """Each job's whole event stream, read in pages."""
        events: dict[str, list] = {job_id: [] for job_id in job_ids}
        after = {job_id: "-" for job_id in job_ids}
        while after:
            pipe = self.redis.pipeline(transaction=False)
            for job_id, start in after.items():
                pipe.xrange(self.keys.events(job_id), start, "+", count=EVENT_PAGE)
            for job_id, page in zip(list(after), pipe.execute()):
                events[job_id].extend(page)
                if len(page) < EVENT_PAGE:
                    del after[job_id]
                else:
                    after[job_id] = "(" + page[-1][0]
        return events

    def publish(self, updates: list[Update], watch: list[tuple[str, str]]) -> tuple[list, list[str]]:
        """Every job's update (events, final result) in one pipeline, and a look at the cancel flag
        and run of each running job in `watch` (job id, run) that has no update. Returns each
        update's outcome (PUBLISH's reply, or the error its job's keys gave) and each watched
        job's: 'lost', 'cancel' or 'ok'. Raises on a transient error: nothing is acknowledged
        unless its result is in Redis."""

        def add(pipe):
            for u in updates:
                pipe.evalsha(PUBLISH.sha, 3, *job_keys(self.keys, u.job_id), *u.publish_args(self.result_ttl_s))
            for job_id, _ in watch:
                pipe.hmget(self.keys.job(job_id), "cancel", "run")

        replies = raise_transient(scripts.execute(self.redis, add, raise_on_error=False))
        watched = []
        for (_, run), reply in zip(watch, replies[len(updates):]):
            if isinstance(reply, Exception):
                raise reply
            cancel, current = reply
            watched.append("lost" if current != run else "cancel" if cancel == "1" else "ok")
        return replies[: len(updates)], watched

    def heartbeat(self, fields: dict[str, str | int | float], ttl_s: float, held: list[str]) -> tuple[int, list[str]]:
        """Refresh this worker's heartbeat hash and index entry, and the idle time of the entries
        it holds (REFRESH). Returns the queue depth and the held entries it has lost."""
        key = self.keys.worker(self.worker)
        index = self.keys.workers(self.queue)
        now = time.time()

        def add(pipe):
            pipe.hset(key, mapping=fields)
            pipe.pexpire(key, int(ttl_s * 1000))
            pipe.zadd(index, {self.worker: now})
            pipe.zremrangebyscore(index, "-inf", now - WORKER_INDEX_RETENTION_S)
            pipe.zadd(self.keys.queues(), {self.queue: now})
            pipe.xlen(self.stream)
            if held:
                pipe.evalsha(REFRESH.sha, 1, self.stream, GROUP, self.worker, *held)

        replies = scripts.execute(self.redis, add)
        return replies[5], replies[6] if held else []

    def release(self, entry_ids: list[str], idle_ms: int) -> int:
        """Hand unfinished entries over to other workers (RELEASE); returns how many were ours."""
        args = (GROUP, self.worker, idle_ms, *entry_ids)
        return scripts.execute(self.redis, lambda pipe: pipe.evalsha(RELEASE.sha, 1, self.stream, *args))[0]

    def leave(self) -> None:
        """Remove this worker's heartbeat: it no longer counts as live."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.delete(self.keys.worker(self.worker))
        pipe.zrem(self.keys.workers(self.queue), self.worker)
        pipe.execute()


class RedisLink:
    """Whether Redis answers, and when to try again when it does not: after a failure the wait
    doubles from BACKOFF_START_S up to `max_s`, with jitter so that a fleet of workers does not
    come back in lockstep."""

    BACKOFF_START_S = 0.05

    def __init__(self, max_s: float):
        self.max_s = max_s
        self.down_since: float | None = None
        self.delay = 0.0
        self.retry_at = 0.0

    @property
    def up(self) -> bool:
        return self.down_since is None

    def ready(self) -> bool:
        """Up, or down and due for another try."""
        return self.down_since is None or time.monotonic() >= self.retry_at

    def failed(self, error: Exception) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self.delay = self.BACKOFF_START_S
            log.warning("Redis unreachable (%s: %s): retrying with backoff; running jobs go on", type(error).__name__, error)
        else:
            self.delay = min(self.delay * 2, self.max_s)
            log.debug("Redis still unreachable: %s", error)
        self.retry_at = now + random.uniform(self.delay / 2, self.delay)

    def succeeded(self) -> float | None:
        """Marks the link up; returns for how long it was down, if it was."""
        if self.down_since is None:
            return None
        down_s, self.down_since = time.monotonic() - self.down_since, None
        return down_s

    def wait(self, at_most_s: float) -> None:
        time.sleep(max(0.0, min(at_most_s, self.retry_at - time.monotonic())))
