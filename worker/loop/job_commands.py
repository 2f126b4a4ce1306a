"""The worker's commands on each job's keys (its hash, event stream and done stream): CLAIM, ADOPT
and FAIL, the read of a resumed job's recorded events, and publication (PUBLISH, the look at a
running job's flags, the wait for replicas). They answer job by job: an error in a job's place
is that job's (worker/loop/rejection.py), and each reply is parsed into the protocol's enums
(producer_client/protocol/replies.py) here, an answer the protocol does not define becoming
UnknownReply. The queue's own keys are WorkerQueue's (worker/loop/worker_queue.py); what a
pipeline met is classified by worker/loop/queue.py (send_pipeline)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis.crc import key_slot

from producer_client.cluster import SyncRedis, is_cluster
from producer_client.keys import Keys
from producer_client.protocol import execution, job_reads
from producer_client.protocol import worker as scripts
from producer_client.protocol.execution import AddCommands, Pipe
from producer_client.protocol.replication import Replication
from producer_client.protocol.replies import (
    Adopted,
    Claim,
    Failed,
    Look,
    Published,
    PublishReply,
    UnknownReply,
    parse_adopt,
    parse_claim,
    parse_fail,
    parse_publish,
    parse_watch,
)
from producer_client.schema import JobResult
from worker.loop.outbox import Update
from worker.loop.queue import ReplicasBehind, send_pipeline

T = TypeVar("T")
EVENT_PAGE = 1000  # event stream entries per XRANGE when a reclaimed job's events are read
# At most this many jobs' publications in one PUBLISH_ROUND or APPEND_ROUND: Redis serves no other
# client while a script runs, so a round of a full worker goes in a few calls rather than one long one.
ROUND_JOBS = 64


class JobCommands:
    """`replication`: how many replicas must confirm a final result before its entry is
    acknowledged (none by default)."""

    def __init__(
        self,
        client: SyncRedis,
        keys: Keys,
        worker: str,
        result_ttl_s: int,
        replication: Replication = Replication(),
    ):
        self.redis = client
        self.keys = keys
        self.worker = worker
        self.result_ttl_s = result_ttl_s
        self.replication = replication

    def _send(self, add_commands: AddCommands, per_command_errors: bool = False) -> list[Any]:
        return send_pipeline(self.redis, add_commands, per_command_errors)

    def claim(self, jobs: list[tuple[str, str, str]]) -> list[Claim | Exception]:
        """CLAIM each (job id, entry id, run token): on one server all in one CLAIM_MANY, on a
        cluster (the jobs' keys in many slots) one CLAIM each. An error in a job's place: its keys
        refused the script, or the reply is not one CLAIM gives (UnknownReply)."""
        if len(jobs) > 1 and not is_cluster(self.redis):
            return self._claim_many(jobs)[0]

        def add(pipe: Pipe) -> None:
            for job_id, entry_id, run in jobs:
                scripts.claim(self.keys, job_id, self.worker, entry_id, self.result_ttl_s, run).add_to(pipe)

        return [_parsed(parse_claim, r) for r in self._send(add, per_command_errors=True)]

    def claim_and_look(
        self, jobs: list[tuple[str, str, str]], look: AddCommands
    ) -> tuple[list[Claim | Exception], Any]:
        """claim()'s replies, on one server, and the reply of `look`, one command sent after the
        claims in the same pipeline (what Redis holds once it has taken the claims)."""
        return self._claim_many(jobs, look)

    def _claim_many(
        self, jobs: list[tuple[str, str, str]], look: AddCommands | None = None
    ) -> tuple[list[Claim | Exception], Any]:
        """CLAIM_MANY's replies, one per job (an error of the whole call, not a job's, in every
        job's place, as separate CLAIMs would each have met it); and `look`'s reply, if any."""
        call = scripts.claim_many(self.keys, self.worker, self.result_ttl_s, jobs)

        def add(pipe: Pipe) -> None:
            call.add_to(pipe)
            if look is not None:
                look(pipe)

        reply, *looked = self._send(add, per_command_errors=True)
        claims = [_parsed(parse_claim, r) for r in _per_job("CLAIM_MANY", reply, len(jobs))]
        return claims, looked[0] if looked else None

    def adopt(self, jobs: list[tuple[str, str]]) -> list[Adopted | Exception]:
        """ADOPT each (job id, run token) after Redis lost the group."""

        def add(pipe: Pipe) -> None:
            for job_id, run in jobs:
                scripts.adopt(self.keys, job_id, run, self.worker).add_to(pipe)

        return [_parsed(parse_adopt, r) for r in self._send(add, per_command_errors=True)]

    def recorded_events(self, job_ids: list[str]) -> dict[str, list[tuple[str, dict[str, str]]] | Exception]:
        """Each job's whole event stream, read in pages, or in its place the error its stream gave
        (a key of another type: a producer may write it)."""
        events: dict[str, list[tuple[str, dict[str, str]]]] = {job_id: [] for job_id in job_ids}
        errors: dict[str, Exception] = {}
        after = {job_id: "-" for job_id in job_ids}
        while after:

            def add(pipe: Pipe) -> None:
                for job_id, start in after.items():
                    job_reads.add_events_page(pipe, self.keys, job_id, start, EVENT_PAGE)

            for job_id, page in zip(list(after), self._send(add, per_command_errors=True)):
                if isinstance(page, Exception):
                    errors[job_id] = page
                    del after[job_id]
                    continue
                events[job_id].extend(page)
                if len(page) < EVENT_PAGE:
                    del after[job_id]
                else:
                    after[job_id] = "(" + page[-1][0]
        return {job_id: errors.get(job_id, read) for job_id, read in events.items()}

    def fail(self, failures: list[tuple[str, JobResult]]) -> list[Failed | Exception]:
        """FAIL each (job id, failed result): jobs whose keys refused the protocol."""

        def add(pipe: Pipe) -> None:
            for job_id, result in failures:
                scripts.fail(
                    self.keys, job_id, result.model_dump_json(), len(result.token_ids), self.result_ttl_s
                ).add_to(pipe)

        return [_parsed(parse_fail, r) for r in self._send(add, per_command_errors=True)]

    def publish(
        self,
        updates: list[Update],
        watch: list[tuple[str, str]],
        forget: Sequence[str] = (),
    ) -> tuple[list[PublishReply | Exception], list[Look | Exception]]:
        """Every job's update (events, final result) in one pipeline, a look at the cancel flag,
        run and streamed flag of each running job in `watch` (job id, run), and the deletion of
        the done stream of each job in `forget` (whatever it answers: its TTL is there). Returns each
        update's reply and each watched job's state, or in its place the error its job's keys gave
        (a transient one too: the caller keeps that update for later and backs off). A lost group
        cannot occur here: these are a job's keys. With a replication to wait for, each final
        result is followed by a WAIT on its job's node, and a result too few replicas confirmed
        answers ReplicasBehind (transient): its entry is not acknowledged yet."""
        finals = [u for u in updates if u.final is not None] if self.replication.waits else []
        cluster = is_cluster(self.redis)
        rounds = self._rounds(updates, cluster)
        unlinks = scripts.forget_done(self.keys, forget, not cluster)

        def add(pipe: Pipe) -> None:
            for appends, round_ in rounds:
                if appends:
                    scripts.append_round(self.keys, [updates[i].append() for i in round_]).add_to(pipe)
                    continue
                calls = [updates[i].publish_call(self.keys, self.result_ttl_s) for i in round_]
                (calls[0] if len(calls) == 1 else scripts.publish_round(calls)).add_to(pipe)
            for job_id, _ in watch:
                job_reads.add_run_flags(pipe, self.keys, job_id)
            for unlink in unlinks:
                scripts.add_unlink(pipe, unlink)
            for u in finals:
                scripts.add_result_replicated(pipe, self.keys, u.job_id, self.result_ttl_s, self.replication)

        replies = execution.execute(self.redis, add, scripts.WORKER_SCRIPTS, raise_on_error=False)
        published: list[PublishReply | Exception] = [None] * len(updates)  # type: ignore[list-item]  # each set below
        for (appends, round_), reply in zip(rounds, replies[: len(rounds)]):
            per_job = _per_job("APPEND_ROUND", reply, len(round_)) if appends else _each_job(reply, len(round_))
            for i, job_reply in zip(round_, per_job):
                published[i] = _parsed(parse_publish, job_reply)
        looked = len(rounds) + len(watch)
        watched = [
            _parsed(functools.partial(parse_watch, run=run), r)
            for (_, run), r in zip(watch, replies[len(rounds) : looked])
        ]
        if not finals:  # no WAIT was sent: every reply stands as it is
            return published, watched
        # each WAIT's, after its EXPIRE
        confirmed = dict(zip((u.job_id for u in finals), replies[looked + len(unlinks) + 1 :: 2]))
        return [self._replicated(u, reply, confirmed.get(u.job_id)) for u, reply in zip(updates, published)], watched

    def _rounds(self, updates: list[Update], cluster: bool) -> list[tuple[bool, list[int]]]:
        """The updates (by index) that each call publishes, and whether the call is APPEND_ROUND (the
        updates that only add tokens: Update.appends) or PUBLISH_ROUND: one for up to ROUND_JOBS
        jobs, those of one hash slot on a cluster (a script's keys must share one)."""
        by_call: dict[tuple[int, bool], list[int]] = {}
        for i, update in enumerate(updates):
            slot = key_slot(self.keys.job(update.job_id).encode()) if cluster else 0
            by_call.setdefault((slot, update.appends), []).append(i)
        return [
            (appends, jobs[at : at + ROUND_JOBS])
            for (_, appends), jobs in by_call.items()
            for at in range(0, len(jobs), ROUND_JOBS)
        ]

    def _replicated(
        self, update: Update, reply: PublishReply | Exception, confirmed: int | Exception | None
    ) -> PublishReply | Exception:
        """A final result's reply, or ReplicasBehind (or the WAIT's own error) in its place when
        fewer replicas than asked have confirmed it."""
        if confirmed is None or not isinstance(reply, PublishReply) or reply.outcome is not Published.WRITTEN:
            return reply
        if isinstance(confirmed, Exception):
            return confirmed
        return (
            reply
            if confirmed >= self.replication.replicas
            else ReplicasBehind(update.job_id, confirmed, self.replication)
        )


def _each_job(reply: object, jobs: int) -> list[object]:
    """A publication call's reply per job: PUBLISH's own for one job, PUBLISH_ROUND's list for
    several (_per_job): each job's publication is safe to send again."""
    return [reply] if jobs == 1 else _per_job("PUBLISH_ROUND", reply, jobs)


def _per_job(script: str, reply: object, jobs: int) -> list[object]:
    """The reply of a script that answers each of `jobs` jobs in a list (CLAIM_MANY, PUBLISH_ROUND),
    per job: an error of the call itself (a job's own comes in its place in the list) for each of
    its jobs, as each job's own call would have met it; a reply of another shape UnknownReply."""
    if isinstance(reply, Exception):
        return [reply] * jobs
    if isinstance(reply, list) and len(reply) == jobs:
        return reply
    return [UnknownReply(script, reply)] * jobs


def _parsed(parse: Callable[[object], T], reply: object) -> T | Exception:
    """`parse(reply)`, or the error in its place: Redis's own, or UnknownReply."""
    if isinstance(reply, Exception):
        return reply
    try:
        return parse(reply)
    except UnknownReply as e:
        return e
