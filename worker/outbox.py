"""What a worker has to tell Redis and has not yet: one update per job (the engine steps since
its last publication, its final result), in the outbox until a publish has carried it; and the
receipts of settled entries: acknowledgements, and dead letters (entries that go to the
dead-letter stream instead)."""
from __future__ import annotations

from dataclasses import dataclass, field

from producer_client.keys import GROUP
from producer_client.schema import JobResult, TokenLogprob
from worker.jobs import ENTRY_FIELDS, Job, token_event

# The dead-letter stream keeps about this many entries (XADD MAXLEN ~): bounded memory, and far
# more than an operator reads before acting on the alert.
DEAD_LETTER_MAXLEN = 10_000


@dataclass
class DeadLetter:
    entry_id: str
    fields: dict[str, str]  # the entry's own: id, v, body
    reason: str
    deliveries: int

    def script_args(self, worker: str, now: float) -> list:
        # The protocol's fields only: a producer's entry may hold any number of others, more than
        # DEADLETTER's Lua can unpack into one XADD.
        fields = {name: value for name, value in self.fields.items() if name in ENTRY_FIELDS}
        letter = {**fields, "entry": self.entry_id, "deliveries": self.deliveries, "reason": self.reason,
                  "worker": worker, "dead_at": now}
        return [GROUP, self.entry_id, DEAD_LETTER_MAXLEN, *(x for kv in letter.items() for x in kv)]


@dataclass
class Update:
    """What one job has to tell Redis and has not yet: the engine steps since its last publication,
    merged into one tokens event (several while Redis is unreachable, else one)."""

    job_id: str
    entry_id: str | None  # None for a job detached from its entry (see ADOPT): nothing to acknowledge
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


@dataclass
class Receipts:
    """What Redis is yet to hear about entries whose job is settled: acknowledge and delete them
    (the job is final in Redis, or the entry was a duplicate), or move them to the dead-letter
    stream. They go with the next read, in its pipeline."""

    acks: list[str] = field(default_factory=list)
    dead_letters: list[DeadLetter] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.acks or self.dead_letters)

    def sent(self) -> None:
        self.acks, self.dead_letters = [], []
