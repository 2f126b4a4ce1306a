"""The Lua scripts of protocol v1 that producers run, and their call builders.

Each script touches the keys of one job only (its hash, event stream and done stream) or of one
queue only (its stream and dead-letter stream): they share a hash tag, so every script is atomic
and Redis Cluster-safe. A job is born here:

    (none) --CREATE--> queued --ENQUEUE--> in the queue stream
    queued --CANCEL--> cancelled            (the worker that reads the entry just drops it)
    any --FOLLOW--> streamed flag up         (a reader of stream(): the worker publishes its tokens as they come)
    failed | (none) --RETRY--> queued --REVIVE--> in the queue stream, out of the dead-letter stream

and moves on through the worker's scripts (producer_client/protocol/worker.py). Every script is safe to run
twice, because a call whose reply was lost (the connection broke after Redis ran it) is retried.

Each script's call builder below owns its key count and argument order.

A note on Lua: a call that is not the last expression of an argument list yields only its first
value, so `f(a, unpack(t), 'X')` passes one element of `t`. Scripts build the whole argument
table and `unpack` it last (tests/queue/test_scripts.py checks every script for this).
"""

from __future__ import annotations

from producer_client.keys import PROTOCOL_VERSION, Keys
from producer_client.protocol.script import Script, ScriptCall, job_keys

# -- a job's keys ---------------------------------------------------------------------------------

# KEYS: job. ARGV: timeout in ms (0 or none: no deadline), the request's fingerprint ('' or none:
# none). Creates the job as queued; with a timeout, its deadline (epoch ms on Redis's clock: TIME)
# goes into the hash, so that status() reports a queued job past it as expired. Returns 1 when the
# caller should enqueue it: the job is new, or it is queued and no enqueue of it was recorded
# (`enqueued`: an earlier submit stopped half-way). 0: it exists and is enqueued, or is past
# queued. -1: it exists for another request (its fingerprint differs): a request_id is bound to
# the request that first used it. Enqueueing twice is harmless: CLAIM drops the second entry.
CREATE = Script(
    "create",
    """
if redis.call('HSETNX', KEYS[1], 'status', 'queued') == 1 then
  if ARGV[2] and ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'fingerprint', ARGV[2]) end
  local timeout = tonumber(ARGV[1] or '0')
  if timeout > 0 then
    local now = redis.call('TIME')
    redis.call('HSET', KEYS[1], 'deadline', now[1] * 1000 + math.floor(now[2] / 1000) + timeout)
  end
  return 1
end
-- HGET, not HMGET: the producers' ACL user runs this script, and has HGET only (see docs/security.md).
local fingerprint = redis.call('HGET', KEYS[1], 'fingerprint')
if fingerprint and ARGV[2] and ARGV[2] ~= '' and fingerprint ~= ARGV[2] then return -1 end
if redis.call('HGET', KEYS[1], 'status') == 'queued' and not redis.call('HGET', KEYS[1], 'enqueued') then
  return 1
end
return 0
""",
)

# KEYS: job, events, done. ARGV: result JSON of a cancelled job. Returns the status before the
# call, or nil if there is no such job. A queued job ends here and now; a running one
# gets the flag its worker reads every step.
CANCEL = Script(
    "cancel",
    """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'cancel', '1', 'result', ARGV[1])
  redis.call('XADD', KEYS[2], '*', 'type', 'end', 'data', ARGV[1])
  redis.call('XADD', KEYS[3], '*', 'data', ARGV[1])
elseif status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
end
return status
""",
)

# KEYS: job. A reader of stream() follows the job: its `streamed` flag goes up, and the worker
# running it (which reads the flag with each look at the job) publishes its tokens within
# stream_interval_s from then on instead of at its checkpoints. Returns 1, or 0 (changing
# nothing) if there is no such job.
FOLLOW = Script(
    "follow",
    """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'streamed', '1')
return 1
""",
)

# KEYS: job, events, done. ARGV: timeout in ms (0: no deadline). An operator retries a dead-lettered
# job: one that failed (poison), whose hash expired, or that an earlier retry left queued before its
# REVIVE. Its hash, events and done entry go, so that result() and stream() of the new run never
# see the old run's end or tokens, and the job is queued again as CREATE makes it (the deadline
# counted from now), flagged enqueued: REVIVE follows. Returns {'queued'}, or {'refused', status}
# for a job that is running or has a final result other than failed, changing nothing.
RETRY = Script(
    "retry",
    """
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'failed' and status ~= 'queued' then return {'refused', status} end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], 'status', 'queued', 'enqueued', '1')
local timeout = tonumber(ARGV[1])
if timeout > 0 then
  local now = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'deadline', now[1] * 1000 + math.floor(now[2] / 1000) + timeout)
end
return {'queued'}
""",
)

# -- a queue's keys -------------------------------------------------------------------------------

# KEYS: queue. ARGV: max depth (0: no bound), job id, protocol version, body.
# Returns {1, entry id}, or {0, depth} when the queue is full. Checking and adding in one
# script makes the bound exact under any number of producers; nothing is ever trimmed.
ENQUEUE = Script(
    "enqueue",
    """
local max = tonumber(ARGV[1])
if max > 0 then
  local depth = redis.call('XLEN', KEYS[1])
  if depth >= max then return {0, depth} end
end
return {1, redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'v', ARGV[3], 'body', ARGV[4])}
""",
)

# KEYS: queue, dead. ARGV: dead letter's entry id, job id, protocol version, body. Moves a dead
# letter back to the queue as a new entry (a fresh delivery count), in one step: a retry run twice
# at once enqueues the job once. Returns the new entry's id, or nil if the letter is gone.
REVIVE = Script(
    "revive",
    """
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then return false end
return redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'v', ARGV[3], 'body', ARGV[4])
""",
)

# KEYS: queue. ARGV: max depth (0: no bound), protocol version, then each job's id and body.
# submit_many's ENQUEUE: adds the jobs in order while the queue holds fewer than max depth entries,
# the bound ENQUEUE keeps for one job, so a chunk that would cross it fills the queue up to it and
# adds no more. Returns {jobs added, depth after}.
ENQUEUE_MANY = Script(
    "enqueue_many",
    """
local max, depth = tonumber(ARGV[1]), redis.call('XLEN', KEYS[1])
local room = (#ARGV - 2) / 2
if max > 0 then room = math.min(room, math.max(0, max - depth)) end
for i = 1, room do
  redis.call('XADD', KEYS[1], '*', 'id', ARGV[2 * i + 1], 'v', ARGV[2], 'body', ARGV[2 * i + 2])
end
return {room, depth + room}
""",
)

PRODUCER_SCRIPTS = (CREATE, CANCEL, FOLLOW, ENQUEUE, ENQUEUE_MANY, RETRY, REVIVE)


# -- call builders: each owns its script's keys and argument order ----------------------------------


def create(keys: Keys, job_id: str, timeout_ms: int, fingerprint: str) -> ScriptCall:
    return ScriptCall(CREATE, (keys.job(job_id),), (timeout_ms, fingerprint))


def cancel(keys: Keys, job_id: str, cancelled_json: str) -> ScriptCall:
    return ScriptCall(CANCEL, job_keys(keys, job_id), (cancelled_json,))


def follow(keys: Keys, job_id: str) -> ScriptCall:
    return ScriptCall(FOLLOW, (keys.job(job_id),))


def retry(keys: Keys, job_id: str, timeout_ms: int) -> ScriptCall:
    return ScriptCall(RETRY, job_keys(keys, job_id), (timeout_ms,))


def enqueue(stream: str, max_depth: int, job_id: str, body: str) -> ScriptCall:
    """ENQUEUE into `stream` (a queue's shared stream or a worker's own); max_depth 0: no bound."""
    return ScriptCall(ENQUEUE, (stream,), (max_depth, job_id, PROTOCOL_VERSION, body))


def revive(keys: Keys, queue: str, letter_id: str, job_id: str, version: str, body: str) -> ScriptCall:
    return ScriptCall(REVIVE, (keys.queue(queue), keys.dead(queue)), (letter_id, job_id, version, body))


def enqueue_many(stream: str, max_depth: int, ids_and_bodies: list[tuple[str, str]]) -> ScriptCall:
    flat = tuple(x for pair in ids_and_bodies for x in pair)
    return ScriptCall(ENQUEUE_MANY, (stream,), (max_depth, PROTOCOL_VERSION, *flat))
