"""The Lua scripts of protocol v2 that only workers run. Like the producers' (producer_client/
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
checkpoint_interval_s. The job's end (END_JOB) writes its result into its hash and into its `done`
stream, which a reader that wants only the result blocks on, and wakes once; then the done stream
goes within seconds, and the event stream at once unless someone streams the job or more than one
run published to it (the `resumed` flag): what a finished job keeps is its hash.

Every script is safe to run twice, because a call whose reply was lost (the connection broke
after Redis ran it) is retried: PUBLISH adds tokens only if the job's token count is still the
one they follow and a `start` only once per run, DEADLETTER acts only on an entry still pending.
What each answers is parsed in producer_client/protocol/replies.py; each script's call builder, at the end,
owns its keys and argument order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any

from producer_client.keys import GROUP, LANES, LUA_STREAM_OF, Keys
from producer_client.protocol.execution import Pipe
from producer_client.protocol.lanes import CREDIT_EVERY, DOORBELL_MAXLEN, LUA_LANES, MAX_WEIGHT, MIN_WEIGHT
from producer_client.protocol.replication import Replication
from producer_client.protocol.script import END_JOB, Script, ScriptCall, job_keys

# -- a job's keys ---------------------------------------------------------------------------------

# Prepended to the scripts that write a job's keys (job, events, done): a producer may write those
# keys, so one may hold another type than the protocol's. Redis does not undo what a script wrote
# before a command failed, so a script that would write more than one of them checks first: it
# then fails whole, with a WRONGTYPE error naming the key, and the worker fails the job (FAIL,
# below). The hash is read first by each (its HMGET meets another type); a job's streams are there
# only once it has run or ended, so wrong_stream_type asks one EXISTS of both and a TYPE only where
# either is there (three TYPEs a job cost Redis about what a claim's own reads and writes do:
# bench/RESULTS.md, "Redis CPU per job"). Its second value, that EXISTS's count, tells a job's end
# that there is no event stream to delete.
JOB_KEY_TYPES = """
local function wrong_type(key, kind)
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= kind then
    return redis.error_reply('WRONGTYPE ' .. key .. ' is a ' .. found .. ', not a ' .. kind)
  end
end

local function wrong_stream_type(events, done)
  local there = redis.call('EXISTS', events, done)
  if there > 0 then
    return wrong_type(events, 'stream') or wrong_type(done, 'stream'), there
  end
  return nil, there
end
"""

# A job's claim, shared by CLAIM and CLAIM_MANY: the job's keys (as KEYS are given), then the
# worker, entry id, result TTL seconds and run token. Returns {'claimed', tokens recorded so far[,
# deadline ms]} (run it; more than 0 tokens: resume it), {'final'} (it has a result already: drop
# the entry) or {'duplicate'} (another entry with the same job id is running it: drop this one), or
# a WRONGTYPE error naming a key of another type (JOB_KEY_TYPES, checked before anything is
# written). A missing hash is claimed too: a raw XADD bypasses the client that would create it.
# Claiming the entry a job is running under again is a reclaim: it starts a new run, and the old
# run's worker can publish nothing more. A job that ended gets the result TTL on its hash and kept
# events (a job a producer cancelled has none until then); its done stream keeps its own, DONE_TTL_MS.
LUA_CLAIM = (
    JOB_KEY_TYPES
    + """
local function claim(job, events, done, worker, entry, ttl, run)
  local got = redis.pcall('HMGET', job, 'result', 'status', 'entry', 'tokens', 'deadline')
  if got.err then return wrong_type(job, 'hash') or got end
  local refused = wrong_stream_type(events, done)
  if refused then return refused end
  if got[1] then
    redis.call('EXPIRE', job, ttl)
    redis.call('EXPIRE', events, ttl)
    return {'final'}
  end
  if got[2] == 'running' and got[3] ~= entry then
    return {'duplicate'}
  end
  redis.call('HSET', job, 'status', 'running', 'worker', worker, 'entry', entry, 'run', run)
  if got[5] then return {'claimed', tonumber(got[4] or '0'), got[5]} end
  return {'claimed', tonumber(got[4] or '0')}
end
"""
)

# KEYS: job, events, done. ARGV: worker, entry id, result TTL seconds, run token. The claim of one
# job (LUA_CLAIM), its reply or its error.
CLAIM = Script("claim", LUA_CLAIM + "return claim(KEYS[1], KEYS[2], KEYS[3], ARGV[1], ARGV[2], ARGV[3], ARGV[4])")

# KEYS: each job's hash, events and done, job after job. ARGV: worker, result TTL seconds, then
# each job's entry id and run token. CLAIM of every job in order, in one call: on one server a
# read's entries are claimed by one EVALSHA instead of one each (an EVALSHA and its arguments a job
# cost Redis about 1.7 us more: bench/RESULTS.md, "Redis CPU per job"); on a cluster the jobs' keys
# lie in many slots, and each gets a CLAIM of its own. Returns each job's CLAIM reply, a key
# of another type's WRONGTYPE error in its job's place (that job only is refused).
CLAIM_MANY = Script(
    "claim_many",
    LUA_CLAIM
    + """
local replies = {}
for i = 0, #KEYS / 3 - 1 do
  local k, a = 3 * i, 2 * i
  replies[i + 1] = claim(KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], ARGV[1], ARGV[a + 3], ARGV[2], ARGV[a + 4])
end
return replies
""",
)

# ARGV of one job's publication, in order (PUBLISH's, and each job's in PUBLISH_ROUND's): run token,
# start JSON, tokens JSON, tokens before them, tokens after them, final status, result JSON, result
# TTL seconds, '1' if the run streams the job (its `stream` option, or a FOLLOW the run saw); ''
# for what the step does not have.
PUBLISH_ARGS = 9

# The Lua of one job's publication, shared by PUBLISH, PUBLISH_ROUND and APPEND_ROUND: publish(job,
# events, done, argv, a) with the job's keys, its arguments argv[a + 1] on. Returns one of:
#   'gone'     Redis has no hash of the job: it lost it (see ADOPT).
#   'ended'    the job has a result from elsewhere (a second finisher): nothing changes, not even
#              the event stream. This very result, written by this run (a call whose reply was
#              lost), answers 'written' again instead: the same JSON, which names the run's worker
#              and times to the microsecond (an ended job's hash keeps no run token, END_JOB).
#   'lost'     another run holds the job, or the recorded tokens are neither those the update
#              follows nor those it ends with (this run's view and Redis's differ): nothing
#              changes. Recorded tokens equal to those the update ends with mean this very update
#              was applied before.
#   'written'  the result is written.
#   else 'cancel' (its cancel flag is up), 'followed' (its streamed flag is up: a reader follows
#   it, see FOLLOW) or 'ok'.
# A run that publishes after another run did raises the job's `resumed` flag. The final step writes
# its events only where the end keeps them (END_JOB): any other job's would go at once. The hash's
# fields are read once, by index, and the step's one HSET names only the fields it changes (a
# running job's tokens alone go in APPEND_ROUND, so this is mostly a run's first publication).
# Each event a run adds is recorded as the hash's `last` (here, or in APPEND_ROUND's HSET), which the
# run's next event names as the one before it in its message (script.py's ADD_EVENT): one field
# more to read and write, where reading the stream's last entry (XREVRANGE) cost Redis more than
# the XADD (bench/RESULTS.md, issue 43). A run that has not started yet trusts no record (another
# run's, maybe of a worker of another version) and reads the stream's last id.
PUBLISH_JOB = (
    JOB_KEY_TYPES
    + END_JOB
    + """
local function publish(job, events, done, argv, a)
  local read = redis.call('HMGET', job, 'status', 'result', 'run', 'tokens', 'started', 'cancel', 'streamed',
    'resumed', 'fingerprint', 'last')
  if not read[1] then return 'gone' end  -- every job's hash has a status: this one has no hash
  local result = read[2]
  if result then
    if result == argv[a + 7] then return 'written' end
    return 'ended'
  end
  local run, before, after = argv[a + 1], argv[a + 4], argv[a + 5]
  if read[3] ~= run then return 'lost' end
  local recorded = read[4] or '0'
  if recorded ~= before and recorded ~= after then
    -- This run already recorded part of the update: an earlier call applied it and its reply was lost.
    local n = tonumber(recorded)
    if n > tonumber(before) and n < tonumber(after) then return 'partial:' .. recorded end
    return 'lost'
  end
  local final = argv[a + 6] ~= ''
  local streams
  if final then
    local refused
    refused, streams = wrong_stream_type(events, done)
    if refused then return refused end
  end
  local started, streamed, resumed = read[5], read[7], read[8]
  local resumes = started and started ~= run and resumed ~= '1'
  local keep = not final or streamed == '1' or argv[a + 9] == '1' or resumed == '1' or resumes
  local starts = argv[a + 2] ~= '' and started ~= run
  local published, added = streamed == '1', nil
  local last = started == run and read[10] or nil  -- the run's own record (LAST_EVENT)
  if keep and starts then
    added = add_event(events, 'start', argv[a + 2], published)
    last = added
  end
  if keep and argv[a + 3] ~= '' and recorded == before then
    added = add_event(events, 'tokens', argv[a + 3], published, last)
    last = added
  end
  if final then
    end_job(job, events, done, argv[a + 6], argv[a + 7], after, read[9], read[6], keep, argv[a + 8], streams == 0, last)
    return 'written'
  end
  -- One HSET, its fields spelled out (a table to unpack costs about what a second HSET does). A
  -- step that starts the run (not a final one) has added its start event.
  if resumes and starts then
    redis.call('HSET', job, 'tokens', after, 'last', added, 'resumed', '1', 'started', run)
  elseif resumes and added then
    redis.call('HSET', job, 'tokens', after, 'last', added, 'resumed', '1')
  elseif resumes then
    redis.call('HSET', job, 'tokens', after, 'resumed', '1')
  elseif starts then
    redis.call('HSET', job, 'tokens', after, 'last', added, 'started', run)
  elseif added then
    redis.call('HSET', job, 'tokens', after, 'last', added)
  else
    redis.call('HSET', job, 'tokens', after)
  end
  if read[6] == '1' then return 'cancel' end
  if streamed == '1' then return 'followed' end
  return 'ok'
end
"""
)

# KEYS: job, events, done. ARGV: one job's (PUBLISH_ARGS). Returns its reply (PUBLISH_JOB).
PUBLISH = Script("publish", PUBLISH_JOB + "return publish(KEYS[1], KEYS[2], KEYS[3], ARGV, 0)\n")

# A caught error is the message (Redis 7.0) or an error table (7.2 on). A message keeps its code
# (OOM, WRONGTYPE...), which tells the worker whether to try again; a Lua error has none: ERR, as
# Redis gives it when it ends a call.
ROUND_ERROR = """
local function error_reply(message)
  if not message:match('^%u+ ') then message = 'ERR ' .. message end
  return redis.error_reply(message)
end
"""

# KEYS: job, events, done of each job. ARGV: each job's PUBLISH_ARGS, in the same order. A round's
# publications of several jobs (of one hash slot, on a cluster) in one call: a call per job cost
# the worker a third to a half more per publication (packing it, its reply), and Redis a fifth
# more when rounds come back to back (bench/RESULTS.md, issue 43). Each job is published as if
# alone: an error its commands meet (a key of another type; OOM, which Redis gives a script's
# writes until it has written once, so a job after one that wrote may write) is its reply in its
# place, after whatever of its own writes came before, as its own call would have ended; the
# others go on. Returns a reply per job (PUBLISH_JOB).
PUBLISH_ROUND = Script(
    "publish_round",
    PUBLISH_JOB
    + ROUND_ERROR
    + """
local replies = {}
for i = 1, #KEYS / 3 do
  local called, reply = pcall(publish, KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i], ARGV, """
    + str(PUBLISH_ARGS)
    + """ * (i - 1))
  if not called and type(reply) ~= 'table' then reply = error_reply(tostring(reply)) end
  replies[i] = reply
end
return replies
""",
)

# KEYS: job and events of each job. ARGV: each job's run token, tokens JSON, tokens before them and
# tokens after them. A round's appends: publications of a running job's tokens alone (no start, no
# end), most of what a streamed job publishes, each answered as PUBLISH would answer it. A job whose
# hash has this run, which has started it, and the recorded tokens these follow takes its events
# and its count at once, from five fields of its hash; any other goes through PUBLISH's own Lua. A
# hash with a run token has no result (END_JOB deletes the token with the hash), so the fields
# PUBLISH reads besides (status, result, resumed, fingerprint) answer nothing here. Half the
# arguments of PUBLISH_ROUND a job, and four of its nine fields read, where each costs Redis about
# a thousand instructions to take in and answer (bench/RESULTS.md, issue 43, "A streamed
# publication's Redis instructions").
APPEND_ROUND = Script(
    "append_round",
    PUBLISH_JOB
    + ROUND_ERROR
    + """
local function append(job, events, a)
  local run, tokens, before = ARGV[a + 1], ARGV[a + 2], ARGV[a + 3]
  local read = redis.call('HMGET', job, 'run', 'started', 'tokens', 'cancel', 'streamed', 'last')
  if read[1] ~= run or read[2] ~= run or (read[3] or '0') ~= before then
    return publish(job, events, nil, {run, '', tokens, before, ARGV[a + 4], '', '', '', ''}, 0)
  end
  local added = add_event(events, 'tokens', tokens, read[5] == '1', read[6])
  redis.call('HSET', job, 'tokens', ARGV[a + 4], 'last', added)
  if read[4] == '1' then return 'cancel' end
  if read[5] == '1' then return 'followed' end
  return 'ok'
end
local replies = {}
for i = 1, #KEYS / 2 do
  local called, reply = pcall(append, KEYS[2 * i - 1], KEYS[2 * i], 4 * (i - 1))
  if not called and type(reply) ~= 'table' then reply = error_reply(tostring(reply)) end
  replies[i] = reply
end
return replies
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
# A failed job keeps whatever events its runs published (END_JOB): the trail of what failed.
FAIL = Script(
    "fail",
    END_JOB
    + """
for i, kind in ipairs({'hash', 'stream', 'stream'}) do
  local found = redis.call('TYPE', KEYS[i]).ok
  if found ~= 'none' and found ~= kind then redis.call('DEL', KEYS[i]) end
end
local result, fingerprint, cancel = unpack(redis.call('HMGET', KEYS[1], 'result', 'fingerprint', 'cancel'))
if result then return 'ended' end
local keep = redis.call('EXISTS', KEYS[2]) == 1
end_job(KEYS[1], KEYS[2], KEYS[3], 'failed', ARGV[1], ARGV[2], fingerprint, cancel, keep, ARGV[3], not keep)
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

# Prepended to the scripts that write a dead letter: add_letter(dead-letter stream, its max length,
# the index in ARGV of the letter's first field). A dead-letter stream of another type (only
# workers and operators may write it: an operator's mistake) holds no letter, the DEL that changed
# its type took them, so it is made anew, as after a DEL: its WRONGTYPE failed the worker's whole
# exchange, which it retried with backoff for ever, serving no job. One TYPE a letter: letters are rare.
LUA_ADD_LETTER = """
local function add_letter(dead, maxlen, first)
  local found = redis.call('TYPE', dead).ok
  if found ~= 'stream' and found ~= 'none' then redis.call('DEL', dead) end
  redis.call('XADD', dead, 'MAXLEN', '~', maxlen, '*', unpack(ARGV, first))
end
"""

# KEYS: queue, dead. ARGV: group, entry id, dead-letter stream max length, then the dead letter's
# fields and values. Moves a pending entry to the dead-letter stream: XADD there, XACK and XDEL
# here, at once. Returns 0, doing nothing, if the entry is no longer pending (moved already).
DEADLETTER = Script(
    "deadletter",
    LUA_ADD_LETTER
    + """
if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1) == 0 then return 0 end
add_letter(KEYS[2], ARGV[3], 4)
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
""",
)

# KEYS: dead. ARGV: dead-letter stream max length, then the dead letter's fields and values. Writes
# the letter of an entry of a worker's own stream, whose hash tag DEADLETTER cannot reach from the
# dead-letter stream's: the worker acknowledges the entry next (worker/loop/streams.py).
LETTER = Script(
    "letter",
    LUA_ADD_LETTER
    + """
add_letter(KEYS[1], ARGV[1], 2)
return 1
""",
)

# KEYS: the queue's stream, the lanes' sorted sets (priority, default, flex), the scheduler hash,
# the doorbell, the set of lane streams (read only to make a lane's sorted set of another type
# anew: LUA_LANES). ARGV: group, consumer, room in each lane (priority, default, flex: how many entries
# of that lane the worker can start now, counting its jobs of lower lanes as room: the engine
# preempts them), the cost of an entry that names none,
# the number of corrections, then each correction's lane, tenant and tokens (what its jobs were
# served, less what READ charged them).
# A worker's read of the lanes (docs/architecture.md, "Sharing rules"), in one call: the
# corrections go to their tenants' counters first; then, while room is left, the highest lane with
# an active tenant is served (a lower lane that has banked a credit goes first, for one entry),
# and within it the tenant with the least counter, several entries at once while it stays least;
# each entry read charges its tenant's counter its cost / its weight, and earns each lower lane
# that waits a credit (CREDIT_EVERY of them buy one entry ahead of the higher lanes). A tenant whose stream is read to its end leaves its
# lane, its counter saved. The queue's own stream is looked at whenever its tenant is not active
# (producers that know no lanes write it). A lane stream that has no group yet is given one; one
# of another type (a producer may write it) leaves its lane and is reported. Last, the doorbell:
# one entry if a lane's stream has work left (an idle worker wakes to take it), none if not
# (nobody needs waking; the queue's own stream wakes its idle readers by itself). Returns {{lane, tenant, {{id, {field, value...}}...}}...}, and {'!', stream, error} for a
# stream that refused.
# With an 8th key, the worker's own stream (cache-aware placement; on one server, where it shares
# the node: a round trip less per read), and a last ARGV, its room for any lane: that stream is
# read first, up to that room, as {'own', '', entries}; the lanes' rooms shrink by what it gave
# (flex's no further than its own ARGV says), and with none left in the highest lane and no
# correction to apply, nothing else is done.
READ = Script(
    "read",
    LUA_STREAM_OF
    + LUA_LANES
    + f"""
local group, consumer = ARGV[1], ARGV[2]
local room = {{tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])}}
local default_cost = tonumber(ARGV[6])
local placed = nil  -- {{'own', '', entries}} of the worker's own stream, where given it
if KEYS[8] then
  local own_room = tonumber(ARGV[#ARGV])
  local reply = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', own_room, 'STREAMS', KEYS[8], '>')
  reply = unless_wrongtype(reply, OTHER_TYPE)
  if reply == OTHER_TYPE then
    -- Producers may write it (mili:q:*): one of another type failed every READ, and the worker
    -- served nothing. Its placed jobs went with the DEL that changed its type; it is made a stream
    -- again with its group, as the worker's start makes it.
    redis.call('DEL', KEYS[8])
    redis.call('XGROUP', 'CREATE', KEYS[8], group, '0', 'MKSTREAM')
    reply = false
  end
  local n = reply and #reply[1][2] or 0
  if n > 0 then placed = {{'own', '', reply[1][2]}} end
  room = {{math.max(0, room[1] - n), math.max(0, room[2] - n), math.min(room[3], math.max(0, own_room - n))}}
  if room[1] <= 0 and tonumber(ARGV[7]) == 0 then return {{placed}} end
end
local sched = KEYS[5]
local weights, costs = {{}}, {{}}
local function weight(tenant)
  if not weights[tenant] then
    local w = stored(sched_field(sched, 'w:' .. tenant), 1)
    weights[tenant] = (w >= {MIN_WEIGHT} and w <= {MAX_WEIGHT}) and w or 1  -- mili quota set's range
  end
  return weights[tenant]
end
local function lane_index(name)
  for i, lane in ipairs(LANES) do if lane == name then return i end end
end
local c = 8
for _ = 1, tonumber(ARGV[7]) do
  local l, tenant, tokens = lane_index(ARGV[c]), ARGV[c + 1], tonumber(ARGV[c + 2])
  c = c + 3
  if l then
    -- A lane's set of another type (a producer wrote it) holds no tenant: the correction goes to the
    -- saved counter, which the set made anew below lifts the tenant to.
    local active = unless_wrongtype(redis.pcall('ZSCORE', KEYS[1 + l], tenant), OTHER_TYPE)
    if active and active ~= OTHER_TYPE then
      redis.call('ZINCRBY', KEYS[1 + l], tokens / weight(tenant), tenant)
    elseif tenant ~= '-' then
      local field = 'c:' .. LANES[l] .. ':' .. tenant  -- read and set: HINCRBYFLOAT refuses a producer's junk
      redis.call('HSET', sched, field, stored(sched_field(sched, field), 0) + tokens / weight(tenant))
    end
  end
end
local waiting, maybe, taken = {{}}, {{}}, {{0, 0, 0}}
-- Redis deletes a sorted set with its last member: one EXISTS of the three lanes tells a queue with
-- no active tenant (most reads) from one with, whose lanes' ZCARDs are asked then (and meet a lane
-- key of another type as before): two commands less a read of a queue without tenants.
local any_lane = redis.call('EXISTS', KEYS[2], KEYS[3], KEYS[4]) > 0
for l = 1, 3 do
  local active = any_lane and unless_wrongtype(redis.pcall('ZCARD', KEYS[1 + l]), OTHER_TYPE)
  if active == OTHER_TYPE then
    -- Of another type (LUA_LANES: a producer wrote it): made anew from the set of lane streams, each
    -- tenant of the lane whose stream holds entries active again at the higher of its saved
    -- counter and the lane's floor, as activate lifts it (one with nothing unread leaves at its
    -- first read; the queue's own stream is probed as ever). Inline: a function here would be
    -- built by every READ.
    redis.call('DEL', KEYS[1 + l])
    local floor = stored(sched_field(sched, 'floor:' .. LANES[l]), 0)
    for _, member in ipairs(unless_wrongtype(redis.pcall('SMEMBERS', KEYS[7]), {{}})) do  -- activate makes it anew
      local lane, tenant = string.match(member, '^([^:]+):(.+)$')
      local length = lane == LANES[l] and unless_wrongtype(redis.pcall('XLEN', stream_of(KEYS[1], lane, tenant)), 0)
      if length and length > 0 then
        local saved = stored(sched_field(sched, 'c:' .. lane .. ':' .. tenant), 0)
        redis.call('ZADD', KEYS[1 + l], math.max(saved, floor), tenant)
      end
    end
    active = redis.call('ZCARD', KEYS[1 + l])
  end
  waiting[l] = active and active > 0
  maybe[l] = waiting[l]
end
-- An empty default lane has no '-' in it; and a lane's credit is read or earned only while a lane
-- waits from the start (the probe can make the default lane wait, and only flex is below it): the
-- queue's own stream alone, a queue without tenants, costs two commands less a read.
local probed = waiting[2] and redis.call('ZSCORE', KEYS[3], '-') ~= false
maybe[2] = maybe[2] or not probed

-- The doorbell, last: one entry if a lane's stream has work `left` (an idle worker wakes to take
-- it), none if not (nobody needs waking; the queue's own stream wakes its idle readers by itself).
local function ring(left)
  local bell = redis.pcall('XLEN', KEYS[6])
  if type(bell) == 'table' then
    -- Of another type: producers may write the doorbell (docs/security.md), and every idle wait
    -- and READ would fail on it. It is made a stream again with its group, which the idle waits
    -- block on.
    redis.call('DEL', KEYS[6])
    redis.call('XGROUP', 'CREATE', KEYS[6], group, '0', 'MKSTREAM')
    bell = 0
  end
  if left and bell == 0 then
    redis.call('XADD', KEYS[6], 'MAXLEN', {DOORBELL_MAXLEN}, '*', 'r', '1')
  elseif not left and bell > 0 then
    redis.call('XTRIM', KEYS[6], 'MAXLEN', 0)
  end
end

-- No lane with an active tenant (a queue without tenants: most reads): all that is left to do is
-- the probe of the queue's own stream (below), so it is done here, and the functions and tables
-- below, which each call builds anew, are built only when it finds an entry (they cost Redis
-- about as much as the read's commands: bench/RESULTS.md, "The Lua of a 1-token job").
local probed_entries = nil
if not (waiting[1] or waiting[2] or waiting[3]) then
  if room[2] > 0 then
    local reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', 1, 'STREAMS', KEYS[1], '>')
    probed_entries = reply and reply[1][2] or {{}}
  end
  if not probed_entries or #probed_entries == 0 then
    ring(false)
    return {{placed}}
  end
end

local credit = {{0, 0, 0}}
if waiting[1] or waiting[2] or waiting[3] then
  local banked = unless_wrongtype(redis.pcall('HMGET', sched, 'credit:default', 'credit:flex'), OTHER_TYPE)
  if banked == OTHER_TYPE then banked = {{sched_field(sched, 'credit:default'), false}} end  -- deleted it
  credit = {{0, stored(banked[1], 0), stored(banked[2], 0)}}
end
local credit_changed = false
local out = {{placed}}

local function want(l)
  return room[l] - taken[1] - taken[2] - taken[3]
end

local function pick()
  for l = 3, 2, -1 do
    if maybe[l] and credit[l] >= {CREDIT_EVERY} and want(l) > 0 then
      for h = 1, l - 1 do
        if waiting[h] and want(h) > 0 then return l, true end
      end
    end
  end
  for l = 1, 3 do
    if maybe[l] and want(l) > 0 then return l, false end
  end
end

local function read(stream, n, queue_stream)
  local reply
  if queue_stream then
    reply = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', stream, '>')
  else
    reply = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', stream, '>')
    if type(reply) == 'table' and reply.err and string.find(reply.err, 'NOGROUP') then
      redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
      reply = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', n, 'STREAMS', stream, '>')
    end
    if type(reply) == 'table' and reply.err then return nil, reply.err end
  end
  if not reply then return {{}} end
  return reply[1][2]
end

local function cost_of(entry)
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'cost' then return tonumber(fields[i + 1]) or default_cost end
  end
  return default_cost
end

local function at_end(stream, entries)
  local last = redis.call('XREVRANGE', stream, '+', '-', 'COUNT', 1)
  return #last == 0 or last[1][1] == entries[#entries][1]
end

-- The queue's own stream's tenant ('-', what producers that know no lanes write) keeps no counter
-- when it leaves: it is lifted to the least active counter whenever it comes back, and a queue
-- without tenants writes nothing here.
local function leave(l, tenant, counter)
  redis.call('ZREM', KEYS[1 + l], tenant)
  local named = tenant ~= '-'
  if named then redis.call('HSET', sched, 'c:' .. LANES[l] .. ':' .. tenant, counter) end
  if redis.call('ZCARD', KEYS[1 + l]) == 0 then
    if named then redis.call('HSET', sched, 'floor:' .. LANES[l], counter) end
    waiting[l] = false
    maybe[l] = l == 2 and not probed
  end
end

-- The queue's own stream while its tenant is not active: one entry (read above already where no
-- lane was active), and if there is one, the tenant joins the default lane (lifted as a
-- producer's activate would) and is served as any.
local function probe()
  probed = true
  local entries = probed_entries or read(KEYS[1], 1, true)
  if #entries == 0 then
    maybe[2] = waiting[2]
    return 0
  end
  table.insert(out, {{'default', '-', entries}})
  if at_end(KEYS[1], entries) then
    maybe[2] = waiting[2]
    return 1
  end
  local least = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  local lift = stored(least[2] or sched_field(sched, 'floor:default'), 0)
  local counter = lift + cost_of(entries[1]) / weight('-')
  redis.call('ZADD', KEYS[3], counter, '-')
  waiting[2] = true
  return 1
end

local function serve(l, credit_used)
  if l == 2 and not probed then return probe() end
  local two = redis.call('ZRANGE', KEYS[1 + l], 0, 1, 'WITHSCORES')
  if #two == 0 then
    waiting[l] = false
    maybe[l] = false
    return 0
  end
  local tenant, counter, w = two[1], tonumber(two[2]), weight(two[1])
  local n = want(l)
  if credit_used then
    n = 1
  else
    if two[3] then
      local per = (costs[tenant] or default_cost) / w
      n = math.min(n, math.max(1, math.floor((tonumber(two[4]) - counter) / per) + 1))
    end
    -- No further than a waiting lower lane's next credit: it is spent in this same call, so a
    -- read of hundreds of entries still gives the lower lane one in CREDIT_EVERY + 1.
    for m = l + 1, 3 do
      if waiting[m] and want(m) > 0 then n = math.min(n, math.max(1, {CREDIT_EVERY} - credit[m])) end
    end
  end
  local stream = stream_of(KEYS[1], LANES[l], tenant)
  local entries, err = read(stream, n, stream == KEYS[1])
  if not entries then
    leave(l, tenant, counter)
    table.insert(out, {{'!', stream, err}})
    return 0
  end
  local charge = 0
  for _, entry in ipairs(entries) do charge = charge + cost_of(entry) end
  if #entries > 0 then
    costs[tenant] = charge / #entries
    counter = counter + charge / w
    table.insert(out, {{LANES[l], tenant, entries}})
  end
  if #entries < n or at_end(stream, entries) then
    leave(l, tenant, counter)
  else
    redis.call('ZADD', KEYS[1 + l], counter, tenant)
  end
  return #entries
end

for _ = 1, 1024 do
  local l, credit_used = pick()
  if not l then break end
  local got = serve(l, credit_used)
  taken[l] = taken[l] + got
  if got > 0 then
    if credit_used then
      credit[l] = credit[l] - {CREDIT_EVERY}
      credit_changed = true
    end
    for m = l + 1, 3 do
      if waiting[m] and credit[m] < {CREDIT_EVERY} then
        credit[m] = math.min({CREDIT_EVERY}, credit[m] + got)
        credit_changed = true
      end
    end
  end
end
if credit_changed then
  redis.call('HSET', sched, 'credit:default', credit[2], 'credit:flex', credit[3])
end
-- Work left in a lane's stream: the queue's own stream aside, whose every XADD wakes a worker
-- blocked on it.
local left = false
for l = 1, 3 do
  if waiting[l] then
    local tenants = redis.call('ZCARD', KEYS[1 + l])
    if l == 2 and redis.call('ZSCORE', KEYS[3], '-') then tenants = tenants - 1 end
    if tenants > 0 then left = true end
  end
end
ring(left)
return out
""",
)

# KEYS: the queue's stream, its set of lane streams. ARGV: group, consumer, min idle ms, count,
# where to start in the set (it rotates, so that every stream's turn comes), handed-over idle ms.
# RECLAIM of every lane stream in one call: up to `count` entries in all idle longer than `min
# idle` (their worker died or stalled, or a drain handed them over), each with its delivery count
# and 1 if a drain had handed it over, as RECLAIM's. A stream with no group or of another type is
# passed over. Returns {next start, {{lane, tenant, {{id, {field, value...}, deliveries, handed
# over}...}}...}}.
RECLAIM_LANES = Script(
    "reclaim_lanes",
    LUA_STREAM_OF
    + LUA_LANES
    + """
local members = unless_wrongtype(redis.pcall('SMEMBERS', KEYS[2]), OTHER_TYPE)
if members == OTHER_TYPE then
  redis.call('DEL', KEYS[2])  -- of another type (LUA_LANES): activate makes it anew, as after a DEL
  return {0, {}}
end
local count, n = tonumber(ARGV[4]), #members
if n == 0 then return {0, {}} end
local start = tonumber(ARGV[5]) % n
local out, visited = {}, 0
for i = 0, n - 1 do
  if count <= 0 then break end
  visited = visited + 1
  local lane, tenant = string.match(members[(start + i) % n + 1], '^([^:]+):(.+)$')
  local stream = stream_of(KEYS[1], lane, tenant)
  local reply = {err = 'the queue stream is reclaimed by RECLAIM'}
  local handed = {}
  if stream ~= KEYS[1] then
    -- read before the claim resets the idle times; an error here is XAUTOCLAIM's too
    local idle = redis.pcall('XPENDING', stream, ARGV[1], 'IDLE', ARGV[6], '-', '+', count)
    if not idle.err then
      for _, p in ipairs(idle) do handed[p[1]] = 1 end
    end
    reply = redis.pcall('XAUTOCLAIM', stream, ARGV[1], ARGV[2], ARGV[3], '0-0', 'COUNT', count)
  end
  if not reply.err then
    local claimed = {}
    for _, entry in ipairs(reply[2]) do
      local pending = redis.call('XPENDING', stream, ARGV[1], entry[1], entry[1], 1)
      table.insert(claimed, {entry[1], entry[2], pending[1][4], handed[entry[1]] or 0})
    end
    if #claimed > 0 then
      table.insert(out, {lane, tenant, claimed})
      count = count - #claimed
    end
  end
end
return {(start + visited) % n, out}
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
WORKER_SCRIPTS = (
    CLAIM,
    CLAIM_MANY,
    PUBLISH,
    PUBLISH_ROUND,
    APPEND_ROUND,
    FAIL,
    ADOPT,
    REQUEUE,
    REFRESH,
    RECLAIM,
    RELEASE,
    DEADLETTER,
    LETTER,
    TAKE_OVER,
    TAKEABLE,
    READ,
    RECLAIM_LANES,
)


# -- call builders: each owns its script's keys and argument order ----------------------------------


def forget_done(keys: Keys, job_ids: Sequence[str], one_server: bool) -> list[tuple[str, ...]]:
    """The UNLINKs (each its keys: add_unlink) that delete ended jobs' done streams once their readers
    have had DONE_TTL_MS (worker/loop/done_sweep.py): on one server one of them all (an UNLINK a
    stream cost redis-server 7.4-8.3k instructions, one of six streams 5.5k a stream:
    bench/RESULTS.md, "Fewer commands a job"); on a cluster one a key, which goes to its node."""
    done = tuple(keys.done(job_id) for job_id in job_ids)
    if one_server:
        return [done] if done else []
    return [(key,) for key in done]


def add_unlink(pipe: Pipe, keys: tuple[str, ...]) -> None:
    pipe.unlink(*keys)


def claim(keys: Keys, job_id: str, worker: str, entry_id: str, result_ttl_s: int, run: str) -> ScriptCall:
    return ScriptCall(CLAIM, job_keys(keys, job_id), (worker, entry_id, result_ttl_s, run))


def claim_many(keys: Keys, worker: str, result_ttl_s: int, jobs: list[tuple[str, str, str]]) -> ScriptCall:
    """CLAIM_MANY of `jobs`, (job id, entry id, run token) each: on one server only."""
    call_keys = tuple(key for job_id, _, _ in jobs for key in job_keys(keys, job_id))
    return ScriptCall(
        CLAIM_MANY, call_keys, (worker, result_ttl_s, *(x for _, entry, run in jobs for x in (entry, run)))
    )


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
    streamed: bool = False,
) -> ScriptCall:
    """PUBLISH of one update; '' for what it does not have (no start, no tokens, no final result).
    `streamed`: the run streams the job, whose end then keeps its events."""
    args = (run, start, tokens, tokens_before, tokens_after, status, result_json, result_ttl_s, "1" if streamed else "")
    return ScriptCall(PUBLISH, job_keys(keys, job_id), args)


def publish_round(calls: Sequence[ScriptCall]) -> ScriptCall:
    """PUBLISH_ROUND of several jobs' PUBLISH calls (`publish`), which it answers in their order.
    On a cluster, the jobs of one hash slot only."""
    # chain's C loop, where a generator over every key and argument resumes once for each (a dozen a job).
    return ScriptCall(
        PUBLISH_ROUND,
        tuple(chain.from_iterable([call.keys for call in calls])),
        tuple(chain.from_iterable([call.args for call in calls])),
    )


# One job's append: (job id, run token, tokens JSON, tokens before them, tokens after them).
Append = tuple[str, str, str, int, int]


def append_round(keys: Keys, appends: Sequence[Append]) -> ScriptCall:
    """APPEND_ROUND of `appends`, which it answers in their order, as PUBLISH would (replies.parse_publish).
    On a cluster, the jobs of one hash slot only."""
    job_keys: list[str] = []
    args: list[str | int] = []
    for job_id, run, tokens, before, after in appends:  # one pass: no tuple a job to slice and chain
        job_keys += (keys.job(job_id), keys.events(job_id))
        args += (run, tokens, before, after)
    return ScriptCall(APPEND_ROUND, tuple(job_keys), tuple(args))


def add_result_replicated(pipe: Any, keys: Keys, job_id: str, result_ttl_s: int, replication: Replication) -> None:
    """After a final PUBLISH of the job, a WAIT for `replication`'s replicas on the job's node. WAIT
    counts the replicas that have this connection's writes; a result published again is a no-op
    that writes nothing, and may go out on another connection. So an EXPIRE (the TTL PUBLISH gave
    the result) goes first: a write that always reaches the replication stream, after the result,
    so a replica that has it has the result. The WAIT's reply (the replicas that confirmed) is the
    second of the two."""
    pipe.expire(keys.job(job_id), result_ttl_s)
    pipe.wait_replicas(keys.job(job_id), replication.replicas, replication.timeout_ms)


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


def deadletter(
    stream: str, dead: str, entry_id: str, dead_maxlen: int, letter: Mapping[str, str | int | float]
) -> ScriptCall:
    """DEADLETTER of a pending entry of `stream`, as a dead letter of fields `letter`."""
    return ScriptCall(
        DEADLETTER, (stream, dead), (GROUP, entry_id, dead_maxlen, *(x for kv in letter.items() for x in kv))
    )


def letter(dead: str, dead_maxlen: int, fields: Mapping[str, str | int | float]) -> ScriptCall:
    """LETTER: a dead letter of `fields` written to `dead`."""
    return ScriptCall(LETTER, (dead,), (dead_maxlen, *(x for kv in fields.items() for x in kv)))


def take_over(
    stream: str, worker: str, min_idle_ms: int, steal_before_ms: int, count: int, handed_over_ms: int
) -> ScriptCall:
    return ScriptCall(TAKE_OVER, (stream,), (GROUP, worker, min_idle_ms, steal_before_ms, count, handed_over_ms))


def takeable(stream: str, min_idle_ms: int, steal_before_ms: int) -> ScriptCall:
    return ScriptCall(TAKEABLE, (stream,), (GROUP, min_idle_ms, steal_before_ms))


def read(
    keys: Keys,
    queue: str,
    worker: str,
    rooms: tuple[int, int, int],
    default_cost: int,
    corrections: dict[tuple[str, str], int],
    own: tuple[str, int] | None = None,
) -> ScriptCall:
    """READ of up to rooms[i] entries of lane LANES[i] or higher; `corrections`: (lane, tenant) ->
    tokens to add to (or, negative, take from) the tenant's counter in the lane. `own`: the
    worker's own stream and its room for any lane, read first (on one server only)."""
    call_keys = (
        keys.queue(queue),
        *(keys.lane(queue, lane) for lane in LANES),
        keys.scheduler(queue),
        keys.doorbell(queue),
        keys.lane_streams(queue),
    )
    flat = tuple(x for (lane, tenant), tokens in corrections.items() for x in (lane, tenant, tokens))
    args = (GROUP, worker, *rooms, default_cost, len(corrections), *flat)
    if own is not None:
        return ScriptCall(READ, (*call_keys, own[0]), (*args, own[1]))
    return ScriptCall(READ, call_keys, args)


def reclaim_lanes(
    keys: Keys, queue: str, worker: str, min_idle_ms: int, count: int, start: int, handed_over_ms: int
) -> ScriptCall:
    call_keys = (keys.queue(queue), keys.lane_streams(queue))
    return ScriptCall(RECLAIM_LANES, call_keys, (GROUP, worker, min_idle_ms, count, start, handed_over_ms))
