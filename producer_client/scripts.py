"""The Lua scripts of protocol v1. Each touches one job's keys only (its hash and its event
stream, which share a hash tag), so each is atomic and Redis Cluster-safe. A job's status
moves only through these scripts (after the client creates it with HSETNX status queued),
which is what makes the transitions race-free:

    queued --claim--> running --finish--> done | failed | cancelled | expired
    queued --cancel-> cancelled            (the worker later just drops the entry)
    (none) --finish-> failed               (an entry that never had a valid job)

Event stream entries have two fields: `type` (start | tokens | end) and `data` (JSON).
"""

# KEYS: job, events. ARGV: result JSON of a cancelled job. Returns the status before the call,
# or nil if there is no such job. A queued job ends here and now; a running one gets the flag
# its worker checks every step.
CANCEL_JOB = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'cancel', '1', 'result', ARGV[1])
  redis.call('XADD', KEYS[2], '*', 'type', 'end', 'data', ARGV[1])
elseif status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
end
return status
"""

# KEYS: job, events. ARGV: worker, entry id, start event JSON, result TTL seconds.
# Returns 'claimed' (run it), 'final' (it already has a result: drop the entry) or
# 'duplicate' (another entry with the same job id is running it: drop this one).
# A missing hash is claimed too: a raw XADD bypasses the client that would create it.
CLAIM_JOB = """
if redis.call('HEXISTS', KEYS[1], 'result') == 1 then
  redis.call('EXPIRE', KEYS[1], ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[4])
  return 'final'
end
if redis.call('HGET', KEYS[1], 'status') == 'running' and redis.call('HGET', KEYS[1], 'entry') ~= ARGV[2] then
  return 'duplicate'
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'entry', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'type', 'start', 'data', ARGV[3])
return 'claimed'
"""

# KEYS: job, events. ARGV: status, result JSON, tokens generated, result TTL seconds.
# Returns 1 if this call wrote the result, 0 if one was there already: the first finisher
# wins and a second one changes nothing, not even the event stream.
FINISH_JOB = """
if redis.call('HEXISTS', KEYS[1], 'result') == 1 then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'result', ARGV[2], 'tokens', ARGV[3])
redis.call('XADD', KEYS[2], '*', 'type', 'end', 'data', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""
