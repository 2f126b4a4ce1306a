"""A queue's dead letters, for operators: list them, show one, retry them, purge them.

A worker moves an entry to `mili:dead:{queue}` once it has been delivered more than
max_deliveries times (see DEADLETTER): the entry's own fields (id, v, body; a lane's entry its cost,
lane and tenant) plus `entry`, `deliveries`, `reason`, `worker` and `dead_at`. The stream keeps
about the last 10,000. A retry returns a job to its lane's stream of its tenant.

A retry re-enqueues the letter's body as a new entry under the same job id (a fresh delivery
count), in two scripts, because a job's keys and a queue's keys never share a script (Redis
Cluster): RETRY sets the job back to queued and removes its old result, events and done entry, so
that result() and stream() wait for the new run; REVIVE then moves the letter back into the queue.
A retry stopped between the two leaves the letter in place and the job queued, and running it
again finishes it. A job that is running, or ended other than failed (done, cancelled, expired),
is refused and keeps its letter.

An ID names a letter by its entry id in the dead-letter stream, or by its job id (the job's
newest letter: found by reading the stream from its newest end, which holds about 10,000).

A queue of several shards has a dead-letter stream per shard (`mili:dead:{queue#i}`, where the
shard's DEADLETTER writes): every operation here covers them all, a letter names its `shard`, and a
retry returns it to its own shard. An entry id is looked for in shard 0 first, then the others.
"""

from __future__ import annotations

import json
import math
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from producer_client.cluster import AsyncRedis, SyncRedis
from producer_client.errors import InvalidArgument, MiliError
from producer_client.keys import DEFAULT_LANE, LANES, NAME_PATTERN, NO_TENANT, TENANT_PATTERN, Keys, check_name
from producer_client.protocol import letters as dead
from producer_client.protocol import producer as scripts
from producer_client.protocol.clock import entry_order, entry_time, epoch_ms
from producer_client.protocol.execution import Pipe
from producer_client.protocol.lanes import DEFAULT_COST
from producer_client.protocol.shards import stored_count
from producer_client.steps import Runner, Steps, checked
from producer_client.validation import DEFAULT_LIMIT, EVENT_ID, check_limit

PAGE = 200  # letters per read when looking for a job id or retrying them all: bodies can be large


class DeadLetterNotFound(MiliError):
    code = "not_found"

    def __init__(self, queue: str, ident: str):
        super().__init__(f"queue {queue!r} has no dead letter {ident!r} (by entry id or job id)")
        self.queue = queue
        self.ident = ident


class NotRetryable(MiliError):
    """The letter's job is running, or ended other than failed; or the letter names no job."""

    code = "not_retryable"


class DeadLetter(BaseModel):
    """One entry of the dead-letter stream."""

    model_config = ConfigDict(frozen=True)

    queue: str
    letter_id: str  # its id in the dead-letter stream
    job_id: str
    entry_id: str  # the queue entry it was
    reason: str
    deliveries: int
    worker: str  # the worker that moved it
    dead_at: float  # epoch seconds on Redis's clock: the letter's id
    fields: dict[str, str]  # every field as the stream holds it, the job's body among them
    shard: int = 0  # the shard of the queue whose dead-letter stream holds it

    @property
    def lane(self) -> str:
        lane = self.fields.get("lane", DEFAULT_LANE)
        return lane if lane in LANES else DEFAULT_LANE

    @property
    def tenant(self) -> str:
        tenant = self.fields.get("tenant", NO_TENANT)
        return tenant if TENANT_PATTERN.fullmatch(tenant) else NO_TENANT

    @classmethod
    def from_entry(cls, queue: str, letter_id: str, fields: dict[str, str], shard: int = 0) -> DeadLetter:
        deliveries = fields.get("deliveries", "")
        return cls(
            queue=queue,
            letter_id=letter_id,
            job_id=fields.get("id", ""),
            entry_id=fields.get("entry", ""),
            reason=fields.get("reason", ""),
            deliveries=int(deliveries) if deliveries.isdigit() else 0,
            worker=fields.get("worker", ""),
            dead_at=entry_time(letter_id),
            fields=fields,
            shard=shard,
        )

    def check_retryable(self) -> None:
        if not NAME_PATTERN.fullmatch(self.job_id):
            raise NotRetryable(f"dead letter {self.letter_id} has no usable job id")
        if "body" not in self.fields:
            raise NotRetryable(f"dead letter {self.letter_id} has no body")

    def timeout_ms(self) -> int:
        """The body's timeout_s in ms (0: none): a retried job's deadline counts from the retry.
        A body the worker will refuse has none; the worker fails it with its code."""
        try:
            timeout = json.loads(self.fields["body"]).get("timeout_s")
        except (ValueError, AttributeError):
            return 0
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            return 0
        return max(1, round(timeout * 1000))


class Retried(BaseModel):
    """What a retry did with one letter."""

    letter_id: str
    job_id: str
    outcome: Literal["retried", "refused", "gone"]  # gone: another retry or a purge took it first
    entry_id: str | None = None  # the new queue entry
    reason: str = ""  # why it was refused


class RetryReply(str, Enum):
    QUEUED = "queued"
    REFUSED = "refused"


class DeadLetters:
    """The dead letters of `queue`. Each method returns its outcome; over an asyncio client (`run`
    is steps.arun) it returns an awaitable of it. Bad arguments raise InvalidArgument at once."""

    def __init__(self, client: SyncRedis | AsyncRedis, keys: Keys, queue: str, run: Runner):
        self.client = client
        self.keys = keys
        self.queue = queue
        self.run = run

    def list(self, limit: int = DEFAULT_LIMIT) -> Any:
        """The newest `limit` letters, newest first."""
        return self.run(self.client, newest_of_all(self.keys, self.queue, check_limit(limit)))

    def get(self, ident: str) -> Any:
        return self.run(self.client, find_in_any(self.keys, self.queue, check_name("id", ident)))

    def retry(self, ident: str) -> Any:
        """Retry one letter; raises NotRetryable, or DeadLetterNotFound."""
        return self.run(self.client, retry_one(self.keys, self.queue, check_name("id", ident)))

    def retry_all(self) -> Any:
        """Retry every letter there is now, oldest first; returns what happened to each."""
        return self.run(self.client, retry_all_shards(self.keys, self.queue))

    def purge(self, ident: str) -> Any:
        """Remove one letter; returns it. The job's hash (failed, poison) expires as any result."""
        return self.run(self.client, purge_one(self.keys, self.queue, check_name("id", ident)))

    def purge_all(self) -> Any:
        """Remove every letter; returns how many."""
        return self.run(self.client, purge_all(self.keys, self.queue))

    def purge_older_than(self, seconds: float) -> Any:
        """Remove the letters that died more than `seconds` ago (Redis's clock); returns how many."""
        return self.run(self.client, purge_all(self.keys, self.queue, check_age(seconds)))


def check_age(seconds: Any) -> float:
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
        raise InvalidArgument("older_than", "must be a positive number of seconds")
    return float(seconds)


# -- the operations, as steps (see producer_client.steps) ---------------------------------------------


def shards_of(keys: Keys, queue: str) -> Steps[range]:
    """The queue's shards (one round trip: its stored count)."""
    return range((yield from stored_count(keys, queue)))


def newest_of_all(keys: Keys, queue: str, limit: int) -> Steps[list[DeadLetter]]:
    """The newest `limit` letters over every shard's stream, newest first."""
    found: list[DeadLetter] = []
    for shard in (yield from shards_of(keys, queue)):
        found += yield from newest(keys, queue, limit, shard)
    return sorted(found, key=lambda letter: entry_order(letter.letter_id), reverse=True)[:limit]


def newest(keys: Keys, queue: str, limit: int, shard: int = 0) -> Steps[list[DeadLetter]]:
    entries = yield from dead.newest_letters(keys, keys.shard(queue, shard), limit)
    return [DeadLetter.from_entry(queue, letter_id, fields, shard) for letter_id, fields in entries]


def find_in_any(keys: Keys, queue: str, ident: str) -> Steps[DeadLetter]:
    """find() in each shard's stream in turn: the first letter found."""
    for shard in (yield from shards_of(keys, queue)):
        try:
            return (yield from find(keys, queue, ident, shard))
        except DeadLetterNotFound:
            continue
    raise DeadLetterNotFound(queue, ident)


def find(keys: Keys, queue: str, ident: str, shard: int = 0) -> Steps[DeadLetter]:
    """The letter with entry id `ident`, else the newest letter of job `ident`, in the shard's stream."""
    name = keys.shard(queue, shard)
    if EVENT_ID.fullmatch(ident):
        entry = yield from dead.letter_at(keys, name, ident)
        if entry is not None:
            return DeadLetter.from_entry(queue, *entry, shard)
    before = "+"
    while True:
        page = yield from dead.newest_letters(keys, name, PAGE, before)
        for letter_id, fields in page:
            if fields.get("id") == ident:
                return DeadLetter.from_entry(queue, letter_id, fields, shard)
        if len(page) < PAGE:
            raise DeadLetterNotFound(queue, ident)
        before = "(" + page[-1][0]


def retry_letters(keys: Keys, queue: str, letters: list[DeadLetter]) -> Steps[list[Retried]]:
    """RETRY each letter's job, then REVIVE the letters whose job it queued: two round trips."""
    outcomes: dict[str, Retried] = {}
    usable = []
    for letter in letters:
        try:
            letter.check_retryable()
            usable.append(letter)
        except NotRetryable as e:
            outcomes[letter.letter_id] = Retried(
                letter_id=letter.letter_id, job_id=letter.job_id, outcome="refused", reason=e.message
            )

    def add_retries(pipe: Pipe) -> None:
        for letter in usable:
            scripts.retry(keys, letter.job_id, letter.timeout_ms()).add_to(pipe)

    queued = []
    for letter, reply in zip(usable, checked((yield add_retries)) if usable else []):
        if RetryReply(reply[0]) is RetryReply.QUEUED:
            queued.append(letter)
        else:
            reason = f"job {letter.job_id!r} is {reply[1]}: only a failed job is retried"
            outcomes[letter.letter_id] = Retried(
                letter_id=letter.letter_id, job_id=letter.job_id, outcome="refused", reason=reason
            )

    def add_revivals(pipe: Pipe) -> None:
        for letter in queued:
            f = letter.fields
            scripts.revive(
                keys,
                keys.shard(queue, letter.shard),
                letter.letter_id,
                letter.job_id,
                f.get("v", ""),
                f["body"],
                letter.lane,
                letter.tenant,
                f.get("cost", str(DEFAULT_COST)),
            ).add_to(pipe)

    for letter, entry_id in zip(queued, checked((yield add_revivals)) if queued else []):
        outcome = "gone" if entry_id is None else "retried"
        outcomes[letter.letter_id] = Retried(
            letter_id=letter.letter_id, job_id=letter.job_id, outcome=outcome, entry_id=entry_id
        )
    return [outcomes[letter.letter_id] for letter in letters]


def retry_one(keys: Keys, queue: str, ident: str) -> Steps[Retried]:
    letter = yield from find_in_any(keys, queue, ident)
    (outcome,) = yield from retry_letters(keys, queue, [letter])
    if outcome.outcome == "refused":
        raise NotRetryable(outcome.reason)
    if outcome.outcome == "gone":
        raise DeadLetterNotFound(queue, ident)
    return outcome


def retry_all_shards(keys: Keys, queue: str) -> Steps[list[Retried]]:
    """retry_all() of each shard's stream in turn."""
    outcomes: list[Retried] = []
    for shard in (yield from shards_of(keys, queue)):
        outcomes += yield from retry_all(keys, queue, shard)
    return outcomes


def retry_all(keys: Keys, queue: str, shard: int = 0) -> Steps[list[Retried]]:
    """Page by page from the oldest letter up to the newest there was at the start: a job that
    dies again while this runs is not retried twice in one call."""
    name = keys.shard(queue, shard)
    last = yield from dead.newest_letters(keys, name, 1)
    outcomes: list[Retried] = []
    after = "-"
    while last:
        page = yield from dead.oldest_letters(keys, name, after, last[0][0], PAGE)
        letters = [DeadLetter.from_entry(queue, *entry, shard) for entry in page]
        outcomes += yield from retry_letters(keys, queue, letters)
        if len(page) < PAGE:
            break
        after = "(" + page[-1][0]
    return outcomes


def purge_one(keys: Keys, queue: str, ident: str) -> Steps[DeadLetter]:
    letter = yield from find_in_any(keys, queue, ident)
    removed = yield from dead.delete_letter(keys, keys.shard(queue, letter.shard), letter.letter_id)
    if not removed:
        raise DeadLetterNotFound(queue, ident)
    return letter


def purge_all(keys: Keys, queue: str, older_than_s: float | None = None) -> Steps[int]:
    """Removes every letter of every shard (or those that died more than `older_than_s` ago, on
    Redis's clock); returns how many."""
    removed = 0
    for shard in (yield from shards_of(keys, queue)):
        if older_than_s is None:
            removed += yield from dead.trim_letters(keys, keys.shard(queue, shard), "MAXLEN", 0)
        else:
            removed += yield from purge_older_than(keys, keys.shard(queue, shard), older_than_s)
    return removed


def purge_older_than(keys: Keys, queue: str, seconds: float) -> Steps[int]:
    (now,) = checked((yield lambda pipe: pipe.time()))
    removed = yield from dead.trim_letters(keys, queue, "MINID", max(0, epoch_ms(now) - round(seconds * 1000)))
    return removed
