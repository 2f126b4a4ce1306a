"""What a worker has to tell Redis and has not yet: one update per job (its output since its last
publication, its final result), in the outbox until Redis has answered a publication of it (a
running job's newest output waits in the job itself until its publication is due: see
worker/loop/pace.py); the failures of jobs whose own keys refused the protocol, for FAIL to write
(worker/loop/rejection.py); and the receipts of settled entries: acknowledgements, and dead
letters (entries that go to the dead-letter stream instead). Holdings (worker/loop/holdings.py) owns
them: no other part of the loop changes them."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer_client.keys import DEFAULT_LANE, Keys
from producer_client.protocol import worker as scripts
from producer_client.protocol.events import encode_tokens
from producer_client.protocol.script import ScriptCall
from producer_client.schema import ErrorInfo, JobResult, TokenLogprob
from worker.loop.fairness import Ledger, Owed
from worker.loop.intake import ENTRY_FIELDS
from worker.loop.jobs import Feed, Job
from worker.loop.streams import route_of_ref


@dataclass
class DeadLetter:
    entry_id: str
    fields: dict[str, str]  # the entry's own: id, v, body
    reason: str
    deliveries: int

    def letter(self, worker: str, now: float) -> dict[str, str | int | float]:
        """The dead letter's fields. The protocol's own of the entry only: a producer's entry may
        hold any number of others, more than DEADLETTER's Lua can unpack into one XADD. An entry of
        a lane's stream gets its lane and tenant, so that a retry returns it there."""
        fields = {name: value for name, value in self.fields.items() if name in ENTRY_FIELDS}
        route = route_of_ref(self.entry_id)
        if route is not None:
            fields.update(lane=route.lane, tenant=route.tenant)
        return {
            **fields,
            "entry": self.entry_id,
            "deliveries": self.deliveries,
            "reason": self.reason,
            "worker": worker,
            "dead_at": now,
        }


@dataclass
class Rejection:
    """A job whose own keys refused the protocol: its failed result, which FAIL writes whatever
    the job's run and recorded tokens, and its entry, acknowledged once the result is written
    (moved to the dead-letter stream with `fields` should even FAIL be refused)."""

    result: JobResult
    entry_id: str | None  # None for a detached job (see ADOPT)
    fields: dict[str, str]
    deliveries: int = 1

    @property
    def job_id(self) -> str:
        return self.result.id

    @property
    def error(self) -> ErrorInfo:
        """What failed the job: a rejection's result is a failed one, built with its error."""
        if self.result.error is None:
            raise HeldStateError(f"job {self.job_id}: rejected without an error")
        return self.result.error


@dataclass
class Update:
    """What one job has to tell Redis and has not yet: its output since its last publication, in
    one tokens event made of cuts (each a piece of output taken at once: one, or several when a
    publication Redis did not answer is sent again with what came after it), and its end."""

    job_id: str
    entry_id: str | None  # None for a job detached from its entry (see ADOPT): nothing to acknowledge
    run: str
    tokens_before: int  # tokens of the job that Redis has already
    start: str = ""  # start event JSON: the run's first publication
    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)  # one piece per cut
    logprobs: list[TokenLogprob] | None = None
    cut_sizes: list[int] = field(default_factory=list)  # tokens of each cut, in order
    final: JobResult | None = None
    # Set for a job that ends in the dead-letter stream: after its final result, its entry moves
    # there instead of being acknowledged.
    dead_letter: DeadLetter | None = None
    # The job is streamed (its `stream` option, or a reader's FOLLOW this run saw): its end keeps its
    # events for its readers (END_JOB), as it does for a FOLLOW the run has not seen yet.
    streamed: bool = False
    # Its job's lane: the slot of a job that ended and waits for Redis to take its result counts
    # against the room of its lane and the lower ones only (Admission.rooms).
    lane: str = DEFAULT_LANE

    def ended(self) -> JobResult:
        """Its final result: asked only of the update of a job that ended."""
        if self.final is None:
            raise HeldStateError(f"job {self.job_id}: its update holds no final result")
        return self.final

    def take(self, job: Job) -> None:
        """Move the job's output that no update holds yet into this one, as one cut."""
        feed = job.feed
        self.streamed = self.streamed or feed.streamed
        if not feed.behind(job):
            return
        logprobs = None if job.logprobs is None else job.logprobs[feed.logprobs :]
        self.add_cut(job.token_ids[feed.tokens :], "".join(job.text[feed.pieces :]), logprobs)
        feed.catch_up(job)

    def add_cut(self, token_ids: list[int], text: str, logprobs: list[TokenLogprob] | None) -> None:
        self.token_ids += token_ids
        self.text.append(text)
        self.cut_sizes.append(len(token_ids))
        if logprobs:
            self.logprobs = (self.logprobs or []) + logprobs

    def absorb(self, later: Update) -> None:
        """Append the same job's next update, made while this one was out (Redis did not take it)."""
        self.token_ids += later.token_ids
        self.text += later.text
        self.cut_sizes += later.cut_sizes
        if later.logprobs:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.start = self.start or later.start
        self.final = later.final or self.final
        self.dead_letter = later.dead_letter or self.dead_letter
        self.streamed = self.streamed or later.streamed
        self.entry_id = later.entry_id

    def skip_recorded(self, recorded: int) -> bool:
        """Drop the leading cuts that Redis already recorded (a publish whose reply was lost
        carried them before more cuts merged in). False unless `recorded` ends one of our cuts."""
        done = cuts = 0
        while cuts < len(self.cut_sizes) and self.tokens_before + done < recorded:
            done += self.cut_sizes[cuts]
            cuts += 1
        if self.tokens_before + done != recorded:
            return False
        self.token_ids = self.token_ids[done:]
        self.text = self.text[cuts:]
        self.cut_sizes = self.cut_sizes[cuts:]
        if self.logprobs is not None:
            self.logprobs = self.logprobs[done:]
        self.tokens_before = recorded
        return True

    @property
    def appends(self) -> bool:
        """Whether it only adds tokens to a running job (no start, no end): a `scripts.Append`,
        which APPEND_ROUND publishes for half of PUBLISH's arguments (worker/loop/job_commands.py)."""
        return not self.start and self.final is None and bool(self.token_ids)

    def append(self) -> scripts.Append:
        """The update as APPEND_ROUND's job: asked only of one that `appends`."""
        tokens = encode_tokens(self.token_ids, "".join(self.text), self.logprobs)
        return self.job_id, self.run, tokens, self.tokens_before, self.tokens_before + len(self.token_ids)

    def publish_call(self, keys: Keys, result_ttl_s: int) -> ScriptCall:
        # A tokens event without ids (held-back text flushed at the end) only comes with the
        # final result, in the same atomic call: PUBLISH's token count check needs ids to
        # make a repeated call harmless.
        tokens = (
            encode_tokens(self.token_ids, "".join(self.text), self.logprobs) if self.token_ids or any(self.text) else ""
        )
        final = (self.final.status, self.final.model_dump_json()) if self.final else ("", "")
        return scripts.publish(
            keys,
            self.job_id,
            self.run,
            self.start,
            tokens,
            self.tokens_before,
            self.tokens_before + len(self.token_ids),
            *final,
            result_ttl_s,
            self.streamed,
        )


class HeldStateError(RuntimeError):
    """A change of a held job's state that the loop never makes (a run ended twice, an entry
    settled that nothing held): a bug, raised where it happens rather than lose a job or write a
    result twice."""


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


class Outbox:
    """Updates not yet in Redis, at most one per job waiting to be sent, and at most one per job out
    (sent in the publication Redis has not answered yet). They leave only once Redis has answered;
    an update Redis did not take comes back in front of the job's newer one. Beside them, the
    failures FAIL is yet to write, and the receipts of settled entries. Holdings' alone: the rest
    of the loop asks Holdings."""

    def __init__(self) -> None:
        self.updates: dict[str, Update] = {}  # waiting to be sent
        self.out: dict[str, Update] = {}  # sent, not answered yet
        self.rejected: dict[str, Rejection] = {}  # failed for their keys, the failure not yet written
        self.receipts = Receipts()
        self.ledger = Ledger()  # what each held entry was charged, and what the lanes are owed

    def __bool__(self) -> bool:
        """Updates waiting or out."""
        return bool(self.updates or self.out)

    def held(self) -> list[Update]:
        return [*self.out.values(), *self.updates.values()]

    def for_job(self, job: Job) -> Update:
        """The job's waiting update, holding all its output so far: a new one follows the output
        that earlier updates hold."""
        update = self.updates.get(job.id)
        if update is None:
            update = self.updates[job.id] = Update(job.id, job.entry_id, job.run, job.feed.tokens, lane=job.route.lane)
        update.take(job)
        return update

    def add(self, update: Update) -> None:
        self.updates[update.job_id] = update

    def end(self, job: Job, result: JobResult) -> None:
        """The run's final result, in its update with all its output: once per run."""
        for u in (self.updates.get(job.id), self.out.get(job.id)):
            if u is not None and u.run == job.run and u.final is not None:
                raise HeldStateError(f"job {job.id}: run {job.run} ended twice")
        self.for_job(job).final = result

    def send_all(self) -> list[Update]:
        """Every waiting update, now out."""
        sent = list(self.updates.values())
        self.out.update(self.updates)
        self.updates = {}
        return sent

    def answered(self, update: Update) -> bool:
        """Whether `update`, sent, is still the job's (the job was not let go of meanwhile): then it
        is no longer out."""
        if self.out.get(update.job_id) is not update:
            return False
        del self.out[update.job_id]
        return True

    def restore(self, update: Update) -> None:
        """An update Redis did not take waits again, before whatever the job added since."""
        newer = self.updates.get(update.job_id)
        if newer is not None:
            update.absorb(newer)
        self.updates[update.job_id] = update

    def written(self, update: Update) -> None:
        """Redis has the job's result, answered to `update`: its entry is acknowledged, or moved to
        the dead-letter stream, with the next read."""
        if self.updates.get(update.job_id) is update or self.out.get(update.job_id) is update:
            raise HeldStateError(f"job {update.job_id}: its entry settled while its update waits for Redis")
        if update.dead_letter is not None:
            self.receipts.dead_letters.append(update.dead_letter)
        elif update.entry_id is not None:
            self.receipts.acks.append(update.entry_id)
        self.ledger.settle(update.entry_id, served(update.final))

    def ack(self, ref: str) -> None:
        """An entry whose job was served nowhere here (a duplicate): acknowledged with the next read."""
        self.receipts.acks.append(ref)
        self.ledger.settle(ref, 0)

    def receipts_sent(self, corrections: Owed) -> None:
        self.receipts.sent()
        self.ledger.sent(corrections)

    def failure_written(self, rejection: Rejection) -> None:
        self._settle_rejection(rejection)
        self.ledger.settle(rejection.entry_id, served(rejection.result))
        if rejection.entry_id is not None:
            self.receipts.acks.append(rejection.entry_id)

    def failure_refused(self, rejection: Rejection, reason: str) -> None:
        self._settle_rejection(rejection)
        self.ledger.settle(rejection.entry_id, served(rejection.result))
        if rejection.entry_id is not None:
            self.receipts.dead_letters.append(
                DeadLetter(rejection.entry_id, rejection.fields, reason, rejection.deliveries)
            )

    def _settle_rejection(self, rejection: Rejection) -> None:
        if self.rejected.get(rejection.job_id) is not rejection:
            raise HeldStateError(f"job {rejection.job_id}: a failure settled that is not held")
        del self.rejected[rejection.job_id]

    def republish_whole(self, job_id: str, job: Job | None, run: str, start_event: str) -> None:
        """A new update for a job whose events Redis lost: `start_event`, then the whole output of
        `job` (None: the job has ended, and its final result holds the whole output)."""
        old = self.updates.get(job_id)
        final = old.final if old is not None else None
        update = Update(job_id, None, run, 0, start=start_event, final=final)
        if job is not None:
            job.feed = Feed(streamed=job.feed.streamed)  # none of its output is in Redis now
            update.take(job)
        elif final is None:
            raise HeldStateError(f"job {job_id}: republished with neither the job nor its final result")
        elif final.token_ids or final.text:
            update.add_cut(list(final.token_ids), final.text, final.logprobs)
        self.add(update)

    def discard(self, job_id: str) -> None:
        """The job's updates, failure and charges, dropped: the job is someone else's now, or final."""
        self.updates.pop(job_id, None)
        self.out.pop(job_id, None)
        self.rejected.pop(job_id, None)
        self.ledger.drop(job_id)

    def ended_lanes(self) -> list[str]:
        """The lane of each job out of the engine whose entry waits for Redis to take its result."""
        return [u.lane for u in self.out.values() if u.final is not None and u.entry_id is not None] + [
            u.lane for u in self.updates.values() if u.final is not None and u.entry_id is not None
        ]

    def ended_count(self) -> int:
        """How many jobs ended_lanes() counts, in a loop that calls nothing: the room for new entries asks
        it three times an iteration, and a Counter (or a generator) costs a Python call a job."""
        count = 0
        for updates in (self.out, self.updates):
            for u in updates.values():
                if u.final is not None and u.entry_id is not None:
                    count += 1
        return count

    def buffered_tokens(self) -> int:
        return sum([len(u.token_ids) for u in self.out.values()]) + sum(
            [len(u.token_ids) for u in self.updates.values()]
        )


def served(result: JobResult | None) -> int:
    """The tokens a job was served: its prompt's and its output's."""
    if result is None:
        return 0
    return result.usage.prompt_tokens + result.usage.completion_tokens
