"""What the protocol's scripts and reads answer the worker, as str-enums. Every reply is parsed here
and nowhere else; a reply that matches none of them raises UnknownReply, which fails the job it
concerns instead of being taken for some other outcome."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

from producer_client.keys import PROTOCOL_VERSION

E = TypeVar("E", bound=enum.Enum)


class UnknownReply(Exception):
    """Redis answered something the protocol does not define (a server-side script of another
    version, or a bug): the job concerned fails with code internal_error."""

    def __init__(self, script: str, reply: object):
        super().__init__(f"{script} answered {reply!r}, which protocol v{PROTOCOL_VERSION} does not define")


class ClaimOutcome(str, enum.Enum):
    CLAIMED = "claimed"  # run it; recorded tokens > 0: resume it
    FINAL = "final"  # it has a result already: drop the entry
    DUPLICATE = "duplicate"  # another entry of the same job is running it: drop this one


@dataclass(frozen=True)
class Claim:
    outcome: ClaimOutcome
    recorded_tokens: int = 0  # tokens earlier runs recorded
    deadline: float | None = None  # epoch seconds on Redis's clock, when the producer gave a timeout


class Published(str, enum.Enum):
    OK = "ok"  # recorded; keep running
    CANCEL = "cancel"  # recorded; the job's cancel flag is up
    FOLLOWED = "followed"  # recorded; a reader follows the job (its streamed flag is up)
    WRITTEN = "written"  # the final result is written (by this run)
    ENDED = "ended"  # the job had a result from elsewhere: nothing changed
    LOST = "lost"  # another run holds the job, or Redis's tokens and this run's disagree
    GONE = "gone"  # Redis has no hash of the job: it lost its data (see ADOPT)
    PARTIAL = "partial"  # an earlier call's reply was lost: Redis holds `recorded` of this update's tokens


@dataclass(frozen=True)
class PublishReply:
    outcome: Published
    recorded: int = 0  # with PARTIAL


class Watched(str, enum.Enum):
    OK = "ok"
    CANCEL = "cancel"
    LOST = "lost"
    GONE = "gone"  # no hash: Redis lost it


@dataclass(frozen=True)
class Look:
    """A running job's hash, looked at: its state for this run, and whether a reader follows it."""

    state: Watched
    streamed: bool = False


class Adopted(str, enum.Enum):
    ADOPTED = "adopted"  # the job is this run's, with no queue entry
    RECREATED = "recreated"  # the same, and Redis had lost its hash: its output goes out again, whole
    ENDED = "ended"  # it has a result
    LOST = "lost"  # another run holds it


class Failed(str, enum.Enum):
    FAILED = "failed"  # the failure is the job's result
    ENDED = "ended"  # it had a result already


class Refusal(str, enum.Enum):
    """Why an enqueue added no more jobs (ENQUEUE, ENQUEUE_LANES)."""

    NONE = ""  # every job was added
    FULL = "full"  # the stream holds max_queue_depth entries: {depth, lane}
    QUOTA = "quota"  # the tenant's unread jobs reached max_waiting: {waiting, max}
    TOO_LARGE = "too_large"  # one job's tokens exceed the tokens-per-minute limit: {tokens, tpm}
    RATE = "rate"  # a rate limit: {retry after ms, "requests" | "tokens"}
    OTHER_TYPE = "other_type"  # the tenant's stream of the job's lane holds another type: {0, lane}


class Enqueued(NamedTuple):
    """What an enqueue answered: how many of its jobs went in, why the next did not, the
    refusal's two values, and the tenant's rate limits after it (ENQUEUE_LANES's last six values:
    limit, remaining and ms to full, of requests then tokens; empty for ENQUEUE). A tuple, not a
    frozen dataclass (some 6k instructions to make): a tenant's every submit makes one."""

    added: int
    refusal: Refusal = Refusal.NONE
    values: tuple[int | str, ...] = ()
    limits: tuple[int, ...] = ()


# An enqueue of one job that went in, as nearly every submit's reply says: made once.
ADDED = Enqueued(1)
# Each refusal by the text ENQUEUE_LANES answers: a lookup, not Refusal(text), Enum's three Python calls.
_REFUSALS = {refusal.value: refusal for refusal in Refusal}


def parse_enqueue(reply: object) -> Enqueued:
    """ENQUEUE's {1, entry id} or {0, depth}; ENQUEUE_LANES's {added, refusal, a, b, limits x6}; a
    placed job's XADD's entry id (producer.PlacedEntry)."""
    if isinstance(reply, str) and is_entry_id(reply):
        return ADDED
    if isinstance(reply, list) and len(reply) == 2:
        if reply[0] == 1:
            return ADDED
        if reply[0] == 0:
            return Enqueued(0, Refusal.FULL, (_count(reply[1], "ENQUEUE", reply), ""))
    if isinstance(reply, list) and len(reply) == 10:
        refusal = _REFUSALS.get(reply[1]) if isinstance(reply[1], str) else None
        if refusal is None:
            raise UnknownReply("ENQUEUE_LANES", reply)
        return Enqueued(_count(reply[0], "ENQUEUE_LANES", reply), refusal, tuple(reply[2:4]), tuple(reply[4:]))
    raise UnknownReply("ENQUEUE", reply)


def is_entry_id(text: str) -> bool:
    """Whether `text` is a stream entry's id, as XADD answers it: <milliseconds>-<sequence>."""
    ms, dash, seq = text.partition("-")
    return bool(dash) and ms.isdigit() and seq.isdigit()


def parse_enqueue_many(reply: object) -> tuple[int, int]:
    """ENQUEUE_MANY's {jobs added, depth after}."""
    if isinstance(reply, list) and len(reply) == 2:
        return _count(reply[0], "ENQUEUE_MANY", reply), _count(reply[1], "ENQUEUE_MANY", reply)
    raise UnknownReply("ENQUEUE_MANY", reply)


def parse_claim(reply: object) -> Claim:
    if isinstance(reply, list) and reply:
        outcome = _member(ClaimOutcome, reply[0], "CLAIM", reply)
        if outcome is not ClaimOutcome.CLAIMED:
            return Claim(outcome)
        if len(reply) in (2, 3):
            deadline = _count(reply[2], "CLAIM", reply) / 1000 if len(reply) == 3 else None
            return Claim(outcome, _count(reply[1], "CLAIM", reply), deadline)
    raise UnknownReply("CLAIM", reply)


# Every reply but PARTIAL's is one of these, made once: a reply per published update is parsed.
_PUBLISHED = {outcome.value: PublishReply(outcome) for outcome in Published if outcome is not Published.PARTIAL}


def parse_publish(reply: object) -> PublishReply:
    parsed = _PUBLISHED.get(reply) if isinstance(reply, str) else None
    if parsed is not None:
        return parsed
    if isinstance(reply, str) and reply.startswith("partial:"):
        return PublishReply(Published.PARTIAL, _count(reply.removeprefix("partial:"), "PUBLISH", reply))
    raise UnknownReply("PUBLISH", reply)


def parse_watch(reply: object, run: str) -> Look:
    """HMGET cancel, run, streamed of a running job that had nothing to publish."""
    if isinstance(reply, list) and len(reply) == 3:
        cancel, current, streamed = reply
        if current is None:  # every running job's hash has a run
            return Look(Watched.GONE)
        if current != run:
            return Look(Watched.LOST)
        return Look(Watched.CANCEL if cancel == "1" else Watched.OK, streamed == "1")
    raise UnknownReply("HMGET", reply)


def parse_adopt(reply: object) -> Adopted:
    return _member(Adopted, reply, "ADOPT", reply)


def parse_fail(reply: object) -> Failed:
    return _member(Failed, reply, "FAIL", reply)


def _member(kind: type[E], value: object, script: str, reply: object) -> E:
    try:
        return kind(value)
    except ValueError:
        raise UnknownReply(script, reply) from None


def _count(value: object, script: str, reply: object) -> int:
    """A count in `reply`: an integer, or its decimal text, never negative."""
    if not isinstance(value, (int, float, str, bytes)):
        raise UnknownReply(script, reply)
    try:
        count = int(value)
    except ValueError:
        raise UnknownReply(script, reply) from None
    if count < 0:
        raise UnknownReply(script, reply)
    return count
