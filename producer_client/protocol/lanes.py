"""What the producers' and the workers' scripts share about lanes and tenants (docs/architecture.md,
"Sharing rules"): how a tenant that gets work becomes active in its lane, lifted to the least
served active tenant's counter so that idle time banks no credit (VTC, Sheng et al., OSDI'24);
how many unread jobs a stream holds; and the constants both sides must agree on.

A lane's active tenants are exactly those whose stream holds entries nobody has read: every
script that adds to a lane stream activates its tenant (ACTIVATE), and the workers' READ
deactivates a tenant once it has read its stream to the end. The queue's own stream (the default
lane's jobs of no tenant) is the one exception: producers and raw XADDs that know no lanes write
it, so READ looks at it whenever its tenant is not active, and activates it when it finds work."""

from __future__ import annotations

from producer_client.keys import GROUP, LANES

# What READ charges a job whose entry names no cost (written by a producer that knows no lanes):
# a prompt of about 64 tokens and the default max_tokens. The worker corrects it when the job ends.
DEFAULT_COST = 320
# The doorbell keeps at most this many entries: each wakes one idle worker.
DOORBELL_MAXLEN = 16
# Anti-starvation: every CREDIT_EVERY entries read from higher lanes while a lower lane waits earn
# it one entry ahead of them (at most one banked: credits are counted in entries, capped at
# CREDIT_EVERY), so that a lower lane gets at least about 1 / (CREDIT_EVERY + 1) of the entries
# read under contention. Measured in bench/tenants.py.
CREDIT_EVERY = 10
# A tenant's weight, its share of a lane's tokens against others': from a thousandth to a thousand
# of the default's 1. Outside it a counter charged cost / weight runs off (a weight of 1e-300 made
# one entry's charge infinite, which Redis stores in a sorted set and a hash reads back as no
# number, so the tenant came first) or never moves; a stored weight outside it (a producer may
# write the scheduler hash) reads as the default.
MIN_WEIGHT = 0.001
MAX_WEIGHT = 1000.0

# Lua: the lanes in order, by their index in KEYS and the replies (1 = priority); stored(value,
# default), a number the scheduler hash holds, or `default` where it holds none, or text that is no
# finite number: producers write that hash (their enqueue script activates tenants in it), and one
# field of theirs must stop no other producer's script, nor a worker's READ.
# The queue's shared sharing keys are the producers' to write too (docs/security.md), so one may
# hold another type; to change a key's type one deletes it first, and what it held is gone with
# that DEL. unless_wrongtype(reply, other): a redis.pcall's reply, or `other` where it is that
# WRONGTYPE (any other error is raised): the scripts pcall the one command of each such key that
# meets it first, so that finding one costs no command more. sched_field(sched, field): a field of
# the scheduler hash, or false; a hash of another type is deleted and reads as a missing one, each
# field its default, and the script's writes to it after go through.
LUA_LANES = (
    "local LANES = {"
    + ", ".join(f"'{lane}'" for lane in LANES)
    + """}
local function stored(value, default)
  local n = tonumber(value)
  if n == nil or n ~= n or n == math.huge or n == -math.huge then return default end
  return n
end

local OTHER_TYPE = {}
local function unless_wrongtype(reply, other)
  if type(reply) ~= 'table' or not reply.err then return reply end
  if string.sub(reply.err, 1, 9) ~= 'WRONGTYPE' then error(reply) end
  return other
end

local function sched_field(sched, field)
  local value = unless_wrongtype(redis.pcall('HGET', sched, field), OTHER_TYPE)
  if value ~= OTHER_TYPE then return value end
  redis.call('DEL', sched)
  return false
end
"""
)

# Prepended to the scripts that add entries to lane streams. activate(zset, sched, streams, bell,
# lane, tenant): a tenant not active in its lane's `zset` becomes so, at the higher of its saved
# counter and the lane's least active counter (or the lane's floor, when no tenant is active); its
# stream joins the queue's set of lane streams; and the doorbell wakes one idle worker. No-op for
# a tenant active already: its stream had unread entries, which no idle worker leaves. Keys of
# another type (LUA_LANES): a lane's `zset` is left to READ, which makes it anew from the set of
# lane streams (the tenant's stream joins that set here); a set of lane streams is made anew with
# this stream (the others join it as their tenants become active again, as after a DEL).
LUA_ACTIVATE = (
    LUA_LANES
    + f"""
local function activate(zset, sched, streams, bell, lane, tenant)
  local active = unless_wrongtype(redis.pcall('ZSCORE', zset, tenant), OTHER_TYPE)
  if active and active ~= OTHER_TYPE then return end
  if not active then
    local least = redis.call('ZRANGE', zset, 0, 0, 'WITHSCORES')
    local lift = stored(least[2] or sched_field(sched, 'floor:' .. lane), 0)
    local saved = stored(sched_field(sched, 'c:' .. lane .. ':' .. tenant), 0)
    redis.call('ZADD', zset, math.max(saved, lift), tenant)  -- '-' has none saved: lifted
  end
  if (lane ~= 'default' or tenant ~= '-')
    and unless_wrongtype(redis.pcall('SADD', streams, lane .. ':' .. tenant), OTHER_TYPE) == OTHER_TYPE then
    redis.call('DEL', streams)
    redis.call('SADD', streams, lane .. ':' .. tenant)
  end
  -- A doorbell of another type (a producer wrote it) rings nobody, and the job is enqueued all the
  -- same: idle workers block for a bounded time, and the next READ makes it a stream again.
  redis.pcall('XADD', bell, 'MAXLEN', {DOORBELL_MAXLEN}, '*', 'r', '1')
end
"""
)

# Prepended to the scripts that count a tenant's waiting jobs: unread(stream), the entries no
# worker has read yet (acknowledged entries are deleted, so the rest are pending). A stream no
# worker has read has no group yet: all of it is unread.
LUA_UNREAD = f"""
local function unread(stream)
  local length = unless_wrongtype(redis.pcall('XLEN', stream), 0)  -- another type holds no job of ours
  if length == 0 then return 0 end
  local pending = redis.pcall('XPENDING', stream, '{GROUP}')
  if type(pending) == 'table' and not pending.err then length = length - pending[1] end
  return length
end
"""
