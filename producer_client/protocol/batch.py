"""The Lua scripts of the Batch API's store (gateway/batch/store.py), and their call builders. A
batch's keys share its hash tag, so each script is atomic and Redis Cluster-safe; every write is
safe to repeat and to race with a second driver that has not yet noticed it lost its lease."""

from __future__ import annotations

from producer_client.keys import Keys
from producer_client.protocol.script import Script, ScriptCall

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


# -- call builders: each owns its script's keys and argument order ----------------------------------


def _flat(fields: dict) -> tuple:
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
    keys: Keys, batch_id: str, allowed: str, status: str, at_field: str, now: int, fields: dict
) -> ScriptCall:
    return ScriptCall(TRANSITION, (keys.batch(batch_id),), (allowed, status, at_field, now, *_flat(fields)))


def finish(keys: Keys, batch_id: str, status: str, at_field: str, now: int, ttl_s: int, files: dict) -> ScriptCall:
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
