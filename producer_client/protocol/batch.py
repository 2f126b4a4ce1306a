"""The Batch API's batches in Redis: the Lua scripts of its store (gateway/batch/store.py) with
their call builders, and every command on a batch's keys and the batches' indexes
(producer_client.keys: batch, batch_input, batch_answered, batch_output, batch_errors,
batch_lease, batches, batches_of, batches_unfinished), each operation a Steps
(producer_client.steps) that the store runs over its connection.

A batch is a hash of its object's fields, how far its driver has got (`next_line`), its TTL (and
its output files', `output_ttl_s`, where its request set one) and its owner. It has no TTL until it ends, however long it runs, and expires `ttl_s` after. Its copy
of its input lines is a hash of runs of LINES_PER_FIELD lines (a value per run rather than per
line: Redis's allocator rounds every value up to a size class, which on a value per line cost
about a fifth of the text again). Its answers are two lists (output, errors) with a bitmap of the
lines answered, and its driver holds a lease, a string with a TTL. The indexes (every batch, each
owner's, the unfinished ones) are sorted sets by creation time, to the microsecond: batches
created within a second keep their order.

A batch's keys share its hash tag, so each script is atomic and Redis Cluster-safe. Every write a
driver makes is safe to repeat, and to race with a second driver that has not yet noticed it lost
its lease: a line is answered through ANSWER, whose SETBIT lets only the first answer of a line in;
statuses move through TRANSITION, from the statuses named only."""

from __future__ import annotations

from collections.abc import Mapping

from producer_client.keys import Keys
from producer_client.protocol.execution import Pipe
from producer_client.protocol.files import Listed, hashes_of, indexes_read, owned_by
from producer_client.protocol.script import Script, ScriptCall, add_all
from producer_client.steps import Steps, checked

LINES_PER_FIELD = 64  # a batch's input lines per hash field
FIELDS_PER_HSET = 1000  # the input's fields per HSET command
ANSWERS_PER_READ = 1000

# KEYS: answered, output, errors, batch. ARGV: line index, 1 (output) or 0 (errors), answer JSON.
# Returns 1, or 0 (changing nothing) if the line was answered already.
ANSWER = Script(
    "batch_answer",
    """
if redis.call('SETBIT', KEYS[1], ARGV[1], 1) == 1 then return 0 end
if ARGV[2] == '1' then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('HINCRBY', KEYS[4], 'completed', 1)
else
  redis.call('RPUSH', KEYS[3], ARGV[3])
  redis.call('HINCRBY', KEYS[4], 'failed', 1)
end
return 1
""",
)

# KEYS: batch. ARGV: the statuses it may move from (space-separated), the new status, the field of
# its timestamp, the time, then more field/value pairs to set. Returns the status after the call
# (the new one, or the one that did not allow the move), or nil if there is no such batch.
TRANSITION = Script(
    "batch_transition",
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if not string.find(' ' .. ARGV[1] .. ' ', ' ' .. status .. ' ', 1, true) then return status end
local fields = {'status', ARGV[2], ARGV[3], ARGV[4]}
for i = 5, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', KEYS[1], unpack(fields))
return ARGV[2]
""",
)

# KEYS: batch, input, answered, output, errors, lease. ARGV: the final status, its timestamp field,
# the time, TTL seconds, then field/value pairs (the output files' ids). The batch ends: its
# working keys go, and its object expires after the TTL. Returns 0 if it had ended already.
FINISH = Script(
    "batch_finish",
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'completed' or status == 'failed' or status == 'expired' or status == 'cancelled' then
  return 0
end
local fields = {'status', ARGV[1], ARGV[2], ARGV[3]}
for i = 5, #ARGV do table.insert(fields, ARGV[i]) end
redis.call('HSET', KEYS[1], unpack(fields))
redis.call('DEL', KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
""",
)

# KEYS: lease. ARGV: holder, TTL ms. Extends the lease if `holder` has it: 1, else 0.
RENEW = Script(
    "batch_renew",
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
""",
)

# KEYS: lease. ARGV: holder. Gives the lease up if `holder` has it.
RELEASE = Script(
    "batch_release",
    """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
""",
)

BATCH_SCRIPTS = (ANSWER, TRANSITION, FINISH, RENEW, RELEASE)
Fields = Mapping[str, str | int | float]  # a batch's hash fields, as HSET and the scripts' ARGV take them


# -- call builders: each owns its script's keys and argument order ----------------------------------


def _flat(fields: Fields) -> tuple[str | int | float, ...]:
    return tuple(x for kv in fields.items() for x in kv)


def answer(keys: Keys, batch_id: str, index: int, ok: bool, answer_json: str) -> ScriptCall:
    batch_keys = (
        keys.batch_answered(batch_id),
        keys.batch_output(batch_id),
        keys.batch_errors(batch_id),
        keys.batch(batch_id),
    )
    return ScriptCall(ANSWER, batch_keys, (index, int(ok), answer_json))


def transition(
    keys: Keys, batch_id: str, allowed: str, status: str, at_field: str, now: int, fields: Fields
) -> ScriptCall:
    return ScriptCall(TRANSITION, (keys.batch(batch_id),), (allowed, status, at_field, now, *_flat(fields)))


def finish(
    keys: Keys, batch_id: str, status: str, at_field: str, now: int, ttl_s: int, files: Mapping[str, str]
) -> ScriptCall:
    batch_keys = (
        keys.batch(batch_id),
        keys.batch_input(batch_id),
        keys.batch_answered(batch_id),
        keys.batch_output(batch_id),
        keys.batch_errors(batch_id),
        keys.batch_lease(batch_id),
    )
    return ScriptCall(FINISH, batch_keys, (status, at_field, now, ttl_s, *_flat(files)))


def renew(keys: Keys, batch_id: str, holder: str, ttl_ms: int) -> ScriptCall:
    return ScriptCall(RENEW, (keys.batch_lease(batch_id),), (holder, ttl_ms))


def release(keys: Keys, batch_id: str, holder: str) -> ScriptCall:
    return ScriptCall(RELEASE, (keys.batch_lease(batch_id),), (holder,))


# -- operations: every command on a batch's keys and the batches' indexes ---------------------------


def create_batch(keys: Keys, batch_id: str, fields: Fields, ttl_s: int, owner: str, created: float) -> Steps[None]:
    """The batch's hash and its place in the indexes (`created`: epoch seconds, their order), once
    each index is read (files.indexes_read: one of another type refuses it with nothing written)."""
    yield from indexes_read((keys.batches(), keys.batches_of(owner), keys.batches_unfinished()), batch_id)

    def add(pipe: Pipe) -> None:
        pipe.hset(keys.batch(batch_id), mapping={**fields, "ttl_s": ttl_s, **owned_by(owner)})
        pipe.zadd(keys.batches(), {batch_id: created})
        pipe.zadd(keys.batches_of(owner), {batch_id: created})
        pipe.zadd(keys.batches_unfinished(), {batch_id: created})

    checked((yield add))


def batch_fields(keys: Keys, batch_id: str) -> Steps[dict[str, str]]:
    """The batch's hash ({} if there is no such batch)."""
    fields: dict[str, str]
    (fields,) = checked((yield lambda pipe: pipe.hgetall(keys.batch(batch_id))))
    return fields


def batch_owner(keys: Keys, batch_id: str) -> Steps[str | None]:
    owner: str | None
    (owner,) = checked((yield lambda pipe: pipe.hget(keys.batch(batch_id), "owner")))
    return owner


def listed_batches(keys: Keys, after: str | None, limit: int, owner: str | None) -> Steps[Listed]:
    """The hashes of up to `limit` + 1 batches, newest first, after the batch `after` in the index
    of `owner` (None: every owner's). Batches that expired leave the index. A batch whose hash
    holds another type is left out and named in `other_type` (it stays in the index, its GET a 500
    key_of_another_type): one bad entry made the whole listing that 500."""
    index = keys.batches() if owner is None else keys.batches_of(owner)
    start = 0
    if after is not None:
        (rank,) = checked((yield lambda pipe: pipe.zrevrank(index, after)))
        start = 0 if rank is None else rank + 1
    listed = Listed([], [])
    while len(listed.found) <= limit:  # a page short of expired batches reads on: has_more stays true
        wanted = limit + 1 - len(listed.found)
        ids, hashes = yield from index_entries(keys, index, start, wanted)
        listed.other_type.extend(batch_id for batch_id, fields in zip(ids, hashes) if fields is None)
        listed.found.extend(fields for fields in hashes if fields)
        gone = [batch_id for batch_id, fields in zip(ids, hashes) if fields == {}]
        if gone:
            yield from leave_index(index, gone)
        if len(ids) < wanted:
            break
        start += len(ids) - len(gone)  # the gone ones left the index: the ranks after them moved up
    return listed


def leave_index(index: str, batch_ids: list[str]) -> Steps[None]:
    checked((yield lambda pipe: pipe.zrem(index, *batch_ids)))


def index_entries(
    keys: Keys, index: str, start: int, count: int
) -> Steps[tuple[list[str], list[dict[str, str] | None]]]:
    """`count` batch ids of the index from rank `start`, newest first, and each one's hash (empty:
    expired; None: of another type)."""
    (ids,) = checked((yield lambda pipe: pipe.zrevrange(index, start, start + count - 1)))
    return ids, hashes_of((yield lambda pipe: [pipe.hgetall(keys.batch(batch_id)) for batch_id in ids]))


def leave_unfinished(keys: Keys, batch_id: str) -> Steps[None]:
    """The batch out of the unfinished ones, unended: for a batch whose hash holds another type,
    which no driver can read nor end (see gateway/batch/driver.py)."""
    checked((yield lambda pipe: pipe.zrem(keys.batches_unfinished(), batch_id)))


def unfinished_batches(keys: Keys) -> Steps[list[str]]:
    ids: list[str]
    (ids,) = checked((yield lambda pipe: pipe.zrange(keys.batches_unfinished(), 0, -1)))
    return ids


def set_fields(keys: Keys, batch_id: str, fields: Fields) -> Steps[None]:
    checked((yield lambda pipe: pipe.hset(keys.batch(batch_id), mapping=fields)))


def move_batch(
    keys: Keys, batch_id: str, allowed: str, status: str, at_field: str, now: int, fields: Fields
) -> Steps[str | None]:
    """TRANSITION: the batch's status after it (see there)."""
    status_after: str | None
    (status_after,) = checked((yield transition(keys, batch_id, allowed, status, at_field, now, fields).add_to))
    return status_after


def finish_batch(
    keys: Keys, batch_id: str, status: str, at_field: str, now: int, ttl_s: int, files: Mapping[str, str]
) -> Steps[None]:
    """FINISH, then the batch out of the unfinished ones: once FINISH has run, never before (a
    batch out of them and not ended would never be driven again)."""
    checked((yield finish(keys, batch_id, status, at_field, now, ttl_s, files).add_to))
    checked((yield lambda pipe: pipe.zrem(keys.batches_unfinished(), batch_id)))


def store_input(keys: Keys, batch_id: str, lines: list[str]) -> Steps[None]:
    """Line i goes in field i // LINES_PER_FIELD, with its neighbours (the lines have no newline)."""
    runs = {
        str(n): "\n".join(lines[start : start + LINES_PER_FIELD])
        for n, start in enumerate(range(0, len(lines), LINES_PER_FIELD))
    }
    names = list(runs)

    def add(pipe: Pipe) -> None:
        for start in range(0, len(names), FIELDS_PER_HSET):
            pipe.hset(
                keys.batch_input(batch_id),
                mapping={name: runs[name] for name in names[start : start + FIELDS_PER_HSET]},
            )

    checked((yield add))


def input_lines(keys: Keys, batch_id: str, indexes: list[int]) -> Steps[list[str]]:
    """The input lines at `indexes`, in that order."""
    fields = sorted({i // LINES_PER_FIELD for i in indexes})
    if not fields:
        return []
    (runs,) = checked((yield lambda pipe: pipe.hmget(keys.batch_input(batch_id), [str(n) for n in fields])))
    lines_of = {n: run.split("\n") for n, run in zip(fields, runs)}
    return [lines_of[i // LINES_PER_FIELD][i % LINES_PER_FIELD] for i in indexes]


def unanswered_lines(keys: Keys, batch_id: str, upto: int) -> Steps[list[int]]:
    """The lines below `upto` not answered yet: those from the first clear bit of the answered
    bitmap (BITPOS) on, looked at one by one."""
    key = keys.batch_answered(batch_id)
    (first,) = checked((yield lambda pipe: pipe.bitpos(key, 0)))
    if first >= upto:
        return []
    bits = checked((yield lambda pipe: [pipe.getbit(key, index) for index in range(first, upto)]))
    return [index for index, bit in zip(range(first, upto), bits) if not bit]


def answer_lines(keys: Keys, batch_id: str, answers: list[tuple[int, bool, str]]) -> Steps[None]:
    """ANSWER of each (line index, whether it goes to the output, its answer's JSON)."""
    if answers:
        checked((yield add_all([answer(keys, batch_id, *line) for line in answers])))


def answers_page(keys: Keys, batch_id: str, ok: bool, start: int) -> Steps[list[str]]:
    """Up to ANSWERS_PER_READ answers of the output (`ok`) or error list, from answer `start`."""
    key = keys.batch_output(batch_id) if ok else keys.batch_errors(batch_id)
    page: list[str]
    (page,) = checked((yield lambda pipe: pipe.lrange(key, start, start + ANSWERS_PER_READ - 1)))
    return page


def take_lease(keys: Keys, batch_id: str, holder: str, ttl_ms: int) -> Steps[bool]:
    (taken,) = checked((yield lambda pipe: pipe.set(keys.batch_lease(batch_id), holder, nx=True, px=ttl_ms)))
    return bool(taken)


def renew_lease(keys: Keys, batch_id: str, holder: str, ttl_ms: int) -> Steps[bool]:
    (renewed,) = checked((yield renew(keys, batch_id, holder, ttl_ms).add_to))
    return bool(renewed)


def release_lease(keys: Keys, batch_id: str, holder: str) -> Steps[None]:
    checked((yield release(keys, batch_id, holder).add_to))
