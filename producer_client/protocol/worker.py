"""The Lua scripts of protocol v1 that only workers run. Like the producers' (producer_client/
protocol/producer.py), each touches the keys of one job only or of one queue only,
so every script is atomic and Redis Cluster-safe. A job's status moves on through them:

    queued | running --CLAIM--> running (a new run) --PUBLISH(final)--> done | failed | cancelled | expired
    (none) | queued | running --ADOPT--> running, detached   (Redis lost the group; see ADOPT)
    (any) --FAIL--> failed   (the job's keys refused a script or a read: see FAIL)
    running, detached --REQUEUE--> queued --ENQUEUE--> in the queue stream

Every CLAIM starts a new *run*, named by a token the claiming worker chooses. PUBLISH writes only
for the job's current run, so a worker that lost its job to a reclaim (it stalled, or was cut
off from Redis) can never add to the job's events or write its result: the run is a fencing
token. A run's first PUBLISH adds a `start` event; a claim of a job that has tokens already
resumes it, and its worker continues from the recorded tokens.

Event stream entries have two fields: `type` (start | tokens | end) and `data` (JSON). A worker
publishes a job's output in pieces (worker/loop/pace.py): one PUBLISH call carries the tokens of every
engine step since the last, so a reader blocked on the stream wakes once per piece, not once per
token or step; a streamed job's piece is at most stream_interval_s old, any other job's at most
checkpoint_interval_s. The job's end also adds its result, the one entry it will ever have, to its
`done` stream: a reader that wants only the result blocks there and wakes once.

Every script is safe to run twice, because a call whose reply was lost (the connection broke
after Redis ran it) is retried: PUBLISH adds tokens only if the job's token count is still the
one they follow and a `start` only once per run, DEADLETTER acts only on an entry still pending.
What each answers is parsed in producer_client/protocol/replies.py; each script's call builder, at the end,
owns its keys and argument order.
"""

from __future__ import annotations

from producer_client.keys import GROUP, Keys
from producer_client.protocol.script import Script, ScriptCall, job_keys

# -- a job's keys ---------------------------------------------------------------------------------

# Prepended to the scripts that write a job's keys (KEYS: job, events, done): a producer may write
# those keys, so one may hold another type than the protocol's. Redis does not undo what a script
# wrote before a command failed, so a script that would write more than one of them asks
# wrong_key_type() first: it then fails whole, with a WRONGTYPE error naming the key, and the
# worker fails the job (FAIL, below). A script whose first write would meet the wrong type needs
# no check (PUBLISH's steps: the hash is read, or the event stream written, first).
JOB_KEY_TYPES = """
local function wrong_key_type()
  for i, kind in ipairs({'hash', 'stream', 'stream'}) do
    local found = redis.call('TYPE', KEYS[i]).ok
    if found ~= 'none' and found ~= kind then
      return redis.error_reply('WRONGTYPE ' .. KEYS[i] .. ' is a ' .. found .. ', not a ' .. kind)
    end
  end
end
"""

# KEYS: job, events, done. ARGV: worker, entry id, result TTL seconds, run token.
# Returns {'claimed', tokens recorded so far[, deadline ms]} (run it; more than 0 tokens:
# resume it), {'final'} (it has a result already: drop the entry) or {'duplicate'} (another entry
# with the same job id is running it: drop this one). A missing hash is claimed too: a raw XADD
# bypasses the client that would create it. Claiming the entry a job is running under again is a
# reclaim: it starts a new run, and the old run's worker can publish nothing more.
CLAIM = Script(
    "claim",
    JOB_KEY_TYPES
    + """
local refused = wrong_key_type()
if refused then return refused end
local result, status, entry, tokens, deadline = unpack(
  redis.call('HMGET', KEYS[1], 'result', 'status', 'entry', 'tokens', 'deadline'))
if result then
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[3]) end
  return {'final'}
end
if status == 'running' and entry ~= ARGV[2] then
  return {'duplicate'}
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'entry', ARGV[2], 'run', ARGV[4])
if deadline then return {'claimed', tonumber(tokens or '0'), deadline} end
return {'claimed', tonumber(tokens or '0')}
""",
)

# KEYS: job, events, done. ARGV: run token, start JSON, tokens JSON, tokens before them, tokens
# after them, final status, result JSON, result TTL seconds; '' for what the step does not have.
# Returns one of:
#   'gone'     Redis has no hash of the job: it lost it (see ADOPT).
#   'ended'    the job has a result from elsewhere (a second finisher): nothing changes, not even
#              the event stream. This very result, written by this run (a call whose reply was
#              lost), answers 'written' again instead.
#   'lost'     another run holds the job, or the recorded tokens are neither those the update
#              follows nor those it ends with (this run's view and Redis's differ): nothing
#              changes. Recorded tokens equal to those the update ends with mean this very update
#              was applied before.
#   'written'  the result is written.
#   else 'cancel' (its cancel flag is up), 'followed' (its streamed flag is up: a reader follows
#   it, see FOLLOW) or 'ok'.
PUBLISH = Script(
    "publish",
    JOB_KEY_TYPES
    + """
local status, result, run, recorded, started, cancel, streamed = unpack(
  redis.call('HMGET', KEYS[1], 'status', 'result', 'run', 'tokens', 'started', 'cancel', 'streamed'))
if not status then return 'gone' end  -- every job's hash has a status: this one has no hash
if result then
  if run == ARGV[1] and result == ARGV[7] then return 'written' end
  return 'ended'
end
if run ~= ARGV[1] then return 'lost' end
recorded = recorded or '0'
if recorded ~= ARGV[4] and recorded ~= ARGV[5] then
  -- This run already recorded part of the update: an earlier call applied it and its reply was lost.
  local n = tonumber(recorded)
  if n > tonumber(ARGV[4]) and n < tonumber(ARGV[5]) then return 'partial:' .. recorded end
  return 'lost'
end
if ARGV[6] ~= '' then
  local refused = wrong_key_type()
  if refused then return refused end
end
local hset = {'HSET', KEYS[1], 'tokens', ARGV[5]}
if ARGV[2] ~= '' and started ~= ARGV[1] then
  redis.call('XADD', KEYS[2], '*', 'type', 'start', 'data', ARGV[2])
  table.insert(hset, 'started')
  table.insert(hset, ARGV[1])
end
if ARGV[3] ~= '' and recorded == ARGV[4] then
  redis.call('XADD', KEYS[2], '*', 'type', 'tokens', 'data', ARGV[3])
end
if ARGV[6] == '' then
  redis.call(unpack(hset))
  if cancel == '1' then return 'cancel' end
  if streamed == '1' then return 'followed' end
  return 'ok'
end
for _, field in ipairs({'status', ARGV[6], 'result', ARGV[7]}) do table.insert(hset, field) end
redis.call(unpack(hset))
redis.call('XADD', KEYS[2], '*', 'type', 'end', 'data', ARGV[7])
redis.call('XADD', KEYS[3], '*', 'data', ARGV[7])
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[8]) end
return 'written'
""",
)

# KEYS: job, events, done. ARGV: run token, worker. Redis lost the queue's consumer group
# (restarted without persistence, flushed, or the group was destroyed), and with it the entries of
# the jobs this worker holds: the worker keeps running them, detached from any entry. Returns
# 'ended' (the job has a result), 'lost' (another run holds it), 'adopted' (its hash still has
# this run) or 'recreated': Redis lost the hash too (or a producer's retried submit recreated it
# as queued), and it is this run's again with no tokens recorded; the worker then publishes the
# job's whole output so far, so that its event stream is complete again. Either way the job's
# `entry` is cleared, so that a stale entry of it, delivered again, is dropped as a duplicate.
ADOPT = Script(
    "adopt",
    """
local status, run, result = unpack(redis.call('HMGET', KEYS[1], 'status', 'run', 'result'))
if result then return 'ended' end
if status == 'running' and run ~= ARGV[1] then return 'lost' end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[2], 'entry', '', 'run', ARGV[1])
if status == 'running' then return 'adopted' end
redis.call('HDEL', KEYS[1], 'started', 'tokens', 'enqueued')
return 'recreated'
""",
)

# KEYS: job. ARGV: run token. A draining worker gives back a detached job (see ADOPT) that has
# no entry to hand over: its status goes back to queued, and the worker then enqueues it anew
# (ENQUEUE), to be claimed and resumed after its recorded tokens. Returns 1, or 0 if the run is
# not the job's or the job has a result.
REQUEUE = Script(
    "requeue",
    """
local run, result = unpack(redis.call('HMGET', KEYS[1], 'run', 'result'))
if result or run ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'entry', '')
return 1
""",
)

# KEYS: job, events, done. ARGV: result JSON of a failed job, tokens in it, result TTL seconds. The
# job fails whatever its run and recorded tokens: its keys refused a script or a read (a key of
# another type, a field no script can read), so no run can go on with it. A key of another type
# than the protocol's is deleted first, so that the failure can be written and read as any
# result. Returns 'failed', or 'ended' (changing nothing but those keys) if the job has a result.
FAIL = Script(
    "fail",
    """
for i, kind in ipairs({'hash', 'stream', 'stream'}) do
  local found = redis.call('TYPE', KEYS[i]).ok
  if found ~= 'none' and found ~= kind then redis.call('DEL', KEYS[i]) end
end
if redis.call('HEXISTS', KEYS[1], 'result') == 1 then return 'ended' end
redis.call('HSET', KEYS[1], 'status', 'failed', 'result', ARGV[1], 'tokens', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'type', 'end', 'data', ARGV[1])
redis.call('XADD', KEYS[3], '*', 'data', ARGV[1])
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[3]) end
return 'failed'
""",
)

# -- a queue's keys -------------------------------------------------------------------------------

# KEYS: queue. ARGV: group, consumer, entry ids. Resets the idle time of the entries still
# pending for this consumer (XCLAIM JUSTID: the delivery count stays), so no other worker's
# XAUTOCLAIM takes them. Returns the ids that are no longer this consumer's: reclaimed by another
# worker while this one was stalled or cut off. Checking before claiming matters: a plain XCLAIM
# would take the entry back from the worker now running the job.
REFRESH = Script(
    "refresh",
    """
local claim, lost = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}, {}
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) == 1 then
    table.insert(claim, ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
table.insert(claim, 'JUSTID')
if #claim > 6 then redis.call(unpack(claim)) end
return lost
""",
)

# Prepended to RECLAIM and TAKE_OVER (KEYS[1], group ARGV[1]): the set of the first `count`
# entries from `start` that a drain handed over (idle longer than `idle`), read before a claim
# resets their idle times, so that a worker says which jobs it took over and which it reclaimed.
HANDED_OVER = """
local function handed_over(start, count, idle)
  local handed = {}
  for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', idle, start, '+', count)) do
    handed[p[1]] = 1
  end
  return handed
end
"""

# KEYS: queue. ARGV: group, consumer, min idle ms, start id, count, handed-over idle ms.
# XAUTOCLAIM of up to `count` entries idle longer than `min idle`, each returned with its
# delivery count (which the claim has just raised) and 1 if a drain had handed it over (idle
# longer than `handed-over idle` before the claim: RELEASE makes it so), else 0: {next start id,
# {{id, {field, value...}, deliveries, handed over}...}}. The idle times are read before the claim
# resets them; the first `count` handed-over entries from the start id include every one it takes.
RECLAIM = Script(
    "reclaim",
    HANDED_OVER
    + """
local handed = handed_over(ARGV[4], ARGV[5], ARGV[6])
local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], 'COUNT', ARGV[5])
local claimed = {}
for _, entry in ipairs(reply[2]) do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], entry[1], entry[1], 1)
  table.insert(claimed, {entry[1], entry[2], pending[1][4], handed[entry[1]] or 0})
end
return {reply[1], claimed}
""",
)

# KEYS: queue. ARGV: group, consumer, idle ms, entry ids. A draining worker hands its unfinished
# entries over: each still pending for it is made idle for `idle ms` (so the next XAUTOCLAIM of
# any worker takes it) with its delivery count lowered by one, which that XAUTOCLAIM restores: a
# graceful hand-over does not count as a delivery towards max_deliveries. Returns how many.
RELEASE = Script(
    "release",
    """
local released = 0
for i = 4, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2])
  if #pending == 1 then
    local count = math.max(0, pending[1][4] - 1)
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'RETRYCOUNT', count, 'JUSTID')
    released = released + 1
  end
end
return released
""",
)

# KEYS: queue, dead. ARGV: group, entry id, dead-letter stream max length, then the dead letter's
# fields and values. Moves a pending entry to the dead-letter stream: XADD there, XACK and XDEL
# here, at once. Returns 0, doing nothing, if the entry is no longer pending (moved already).
DEADLETTER = Script(
    "deadletter",
    """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
""",
)

# Prepended to the scripts that read a worker's own stream (KEYS[1], group ARGV[1]): the group's
# last-delivered id, or nil when Redis has no such group (it lost it, or none was made yet).
LAST_DELIVERED = """
local function last_delivered()
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local info = {}
    for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
    if info['name'] == ARGV[1] then return info['last-delivered-id'] end
  end
end
"""

# KEYS: one worker's own stream (cache-aware placement: docs/architecture.md). ARGV: group, consumer,
# min idle ms, steal before (epoch ms on Redis's clock; 0: steal nothing), count, handed-over idle
# ms. Takes up to `count`
# entries of the stream: first those pending longer than `min idle` (their owner died or stalled,
# XAUTOCLAIM as RECLAIM does on the shared stream), then entries nobody has read yet that were added
# before `steal before` (their owner is busy, stalled or gone: a steal), oldest first. A stream of
# another type is passed over (a producer may write it), and one whose group Redis lost is given a
# new one from its start, so that entries of a worker that died meanwhile are still taken. Returns
# {{{id, {field, value...}, deliveries, handed over}...} reclaimed, {{id, {field, value...}}...} stolen},
# `handed over` as RECLAIM's.
TAKE_OVER = Script(
    "take_over",
    LAST_DELIVERED
    + HANDED_OVER
    + """
if redis.call('TYPE', KEYS[1]).ok ~= 'stream' then return {{}, {}} end
local last = last_delivered()
if not last then
  redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], '0')
  last = '0-0'
end
local count = tonumber(ARGV[5])
local reclaimed = {}
local handed = handed_over('0-0', count, ARGV[6])
local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], '0-0', 'COUNT', count)
for _, entry in ipairs(reply[2]) do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], entry[1], entry[1], 1)
  table.insert(reclaimed, {entry[1], entry[2], pending[1][4], handed[entry[1]] or 0})
end
count = count - #reclaimed
local before = tonumber(ARGV[4])
if count <= 0 or before <= 0 then return {reclaimed, {}} end
local due = 0
for _, entry in ipairs(redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', count)) do
  if tonumber(string.match(entry[1], '^(%d+)')) >= before then break end
  due = due + 1
end
if due == 0 then return {reclaimed, {}} end
local read = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', due, 'STREAMS', KEYS[1], '>')
return {reclaimed, read[1][2]}
""",
)

# KEYS: one worker's own stream. ARGV: group, min idle ms, steal before (epoch ms; 0: none). Whether
# TAKE_OVER, given the same arguments, would take anything: 1 or 0. Reads only, so that a worker with
# room asks every worker's stream in one pipeline and runs TAKE_OVER (which takes no more than it
# has room for, and so goes one stream at a time) only where there is something to take.
TAKEABLE = Script(
    "takeable",
    LAST_DELIVERED
    + """
if redis.call('TYPE', KEYS[1]).ok ~= 'stream' then return 0 end
local last = last_delivered()
if not last then
  if redis.call('XLEN', KEYS[1]) > 0 then return 1 end
  return 0
end
if #redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[2], '-', '+', 1) > 0 then return 1 end
local before = tonumber(ARGV[3])
if before <= 0 then return 0 end
local unread = redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', 1)
if #unread == 0 then return 0 end
if tonumber(string.match(unread[1][1], '^(%d+)')) < before then return 1 end
return 0
""",
)

# What a worker's pipelines run besides the producers' scripts (of which ENQUEUE gives a detached
# job back to the queue, after REQUEUE): `execute` loads both sets on NOSCRIPT.
WORKER_SCRIPTS = (CLAIM, PUBLISH, FAIL, ADOPT, REQUEUE, REFRESH, RECLAIM, RELEASE, DEADLETTER, TAKE_OVER, TAKEABLE)


# -- call builders: each owns its script's keys and argument order ----------------------------------


def claim(keys: Keys, job_id: str, worker: str, entry_id: str, result_ttl_s: int, run: str) -> ScriptCall:
    return ScriptCall(CLAIM, job_keys(keys, job_id), (worker, entry_id, result_ttl_s, run))


def publish(
    keys: Keys,
    job_id: str,
    run: str,
    start: str,
    tokens: str,
    tokens_before: int,
    tokens_after: int,
    status: str,
    result_json: str,
    result_ttl_s: int,
) -> ScriptCall:
    """PUBLISH of one update; '' for what it does not have (no start, no tokens, no final result)."""
    args = (run, start, tokens, tokens_before, tokens_after, status, result_json, result_ttl_s)
    return ScriptCall(PUBLISH, job_keys(keys, job_id), args)


def adopt(keys: Keys, job_id: str, run: str, worker: str) -> ScriptCall:
    return ScriptCall(ADOPT, job_keys(keys, job_id), (run, worker))


def requeue(keys: Keys, job_id: str, run: str) -> ScriptCall:
    return ScriptCall(REQUEUE, (keys.job(job_id),), (run,))


def fail(keys: Keys, job_id: str, failed_json: str, tokens: int, result_ttl_s: int) -> ScriptCall:
    return ScriptCall(FAIL, job_keys(keys, job_id), (failed_json, tokens, result_ttl_s))


def refresh(stream: str, worker: str, entry_ids: list[str]) -> ScriptCall:
    return ScriptCall(REFRESH, (stream,), (GROUP, worker, *entry_ids))


def reclaim(stream: str, worker: str, min_idle_ms: int, cursor: str, count: int, handed_over_ms: int) -> ScriptCall:
    return ScriptCall(RECLAIM, (stream,), (GROUP, worker, min_idle_ms, cursor, count, handed_over_ms))


def release(stream: str, worker: str, idle_ms: int, entry_ids: list[str]) -> ScriptCall:
    return ScriptCall(RELEASE, (stream,), (GROUP, worker, idle_ms, *entry_ids))


def deadletter(stream: str, dead: str, entry_id: str, dead_maxlen: int, letter: dict) -> ScriptCall:
    """DEADLETTER of a pending entry of `stream`, as a dead letter of fields `letter`."""
    return ScriptCall(
        DEADLETTER, (stream, dead), (GROUP, entry_id, dead_maxlen, *(x for kv in letter.items() for x in kv))
    )


def take_over(
    stream: str, worker: str, min_idle_ms: int, steal_before_ms: int, count: int, handed_over_ms: int
) -> ScriptCall:
    return ScriptCall(TAKE_OVER, (stream,), (GROUP, worker, min_idle_ms, steal_before_ms, count, handed_over_ms))


def takeable(stream: str, min_idle_ms: int, steal_before_ms: int) -> ScriptCall:
    return ScriptCall(TAKEABLE, (stream,), (GROUP, min_idle_ms, steal_before_ms))
