"""The Lua scripts of protocol v2 that producers run, and their call builders.

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

from dataclasses import dataclass
from typing import Any, NamedTuple

from producer_client.keys import CANCELLED_TTL_S, DEFAULT_LANE, LANES, NO_TENANT, PROTOCOL_VERSION, Keys
from producer_client.protocol.lanes import LUA_ACTIVATE, LUA_LANES, LUA_UNREAD
from producer_client.protocol.script import END_JOB, Script, ScriptCall, job_keys

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
-- A job key of another type (a producer may write one) is no request of this one's: -1, as for a
-- fingerprint of another request, and nothing is written.
local fresh = redis.pcall('HSETNX', KEYS[1], 'status', 'queued')
if type(fresh) == 'table' and fresh.err and string.sub(fresh.err, 1, 9) == 'WRONGTYPE' then return -1 end
if type(fresh) == 'table' then return redis.error_reply(fresh.err) end
if fresh == 1 then
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

# KEYS: jobs with fresh ids, all on one server (a cluster spreads them over slots: there each gets
# CREATE or an HSETNX of its own). ARGV: each job's timeout in ms (0: no deadline). CREATE of each
# job, as it creates a job with a fresh id: no fingerprint (no request_id), and no answer to read
# (a fresh id cannot collide). One command for a chunk of submit_many's jobs: a command per job
# cost the producer and Redis more than the job's own writes. Returns how many it created.
CREATE_MANY = Script(
    "create_many",
    """
local now, created = nil, 0
for i = 1, #KEYS do
  if redis.call('HSETNX', KEYS[i], 'status', 'queued') == 1 then
    created = created + 1
    local timeout = tonumber(ARGV[i])
    if timeout > 0 then
      now = now or redis.call('TIME')
      redis.call('HSET', KEYS[i], 'deadline', now[1] * 1000 + math.floor(now[2] / 1000) + timeout)
    end
  end
end
return created
""",
)

# KEYS: job, events, done. ARGV: result JSON of a cancelled job, TTL seconds of a queued one's keys.
# Returns the status before the call, or nil if there is no such job. A queued job ends here and
# now (END_JOB), with the TTL (CANCELLED_TTL_S), so that its keys go even if no worker ever reads
# its entry; a worker's claim of the entry gives them its result_ttl_s. A running one gets the
# flag its worker reads every step. A job stream of another type (a producer may
# write one) is a WRONGTYPE error before anything is written, as the worker's scripts check
# (JOB_KEY_TYPES): Redis does not undo a script's writes before a failed command, and END_JOB
# rewrote the hash before its XADD met the stream. A producer's ACL has no TYPE: an XLEN of each
# stream, only for a queued job, meets another type.
CANCEL = Script(
    "cancel",
    END_JOB
    + """
local status, tokens, fingerprint, streamed, resumed = unpack(
  redis.call('HMGET', KEYS[1], 'status', 'tokens', 'fingerprint', 'streamed', 'resumed'))
if not status then return false end
if status == 'queued' then
  for i = 2, 3 do
    local length = redis.pcall('XLEN', KEYS[i])
    if type(length) == 'table' then return length end
  end
  local keep = streamed == '1' or resumed == '1'
  end_job(KEYS[1], KEYS[2], KEYS[3], 'cancelled', ARGV[1], tokens, fingerprint, '1', keep, ARGV[2])
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

# KEYS: queue. ARGV: max depth (0: no bound), job id, protocol version, body. Returns {1, entry
# id}, or {0, depth} when the queue is full. Checking and adding in one script makes the bound
# exact under any number of producers; nothing is ever trimmed. A job placed on a worker's own
# stream, which has no bound, goes there by a plain XADD instead (PlacedEntry).
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

# KEYS: the queue's scheduler hash, its set of lane streams, its doorbell, the tenant's rate-limit
# hash, the lanes' sorted sets (priority, default, flex), then the tenant's stream in each lane in
# the same order. ARGV: max depth of one stream (0: no bound), tenant ('-': none), weight ('':
# unchanged), requests and tokens per minute and max waiting jobs (0: no limit each), '1' to
# reserve only (check and count, add nothing: a job placed on a worker's own stream), protocol
# version, then for each job: its lane (1-3, in LANES order), cost (its tokens: the prompt's
# estimate and max_tokens), the requests it counts (1; 0 for a further job of one HTTP request:
# OpenAI counts a request with n choices as one request and all of their tokens), the tokens it
# counts (its cost; a request's first job counts every choice's, the further ones 0: a request
# goes in whole or not at all), id, body.
# The sharing rules' one atomic step: adds the jobs in order while the stream stays under max
# depth, the tenant's unread jobs across its lanes under max waiting, and both rate limits allow
# (GCRA on Redis's clock, each bucket holding a minute's limit: no more than the limit plus one
# full bucket pass in any minute); each job's tenant becomes active in its lane (activate). A job
# refused stops the call, and what it refused counts nothing. Returns {jobs added, why the next
# was refused ('' none; 'full' {depth, lane}; 'quota' {waiting, max}; 'too_large' {tokens, tpm};
# 'rate' {retry after ms, 'requests' | 'tokens'}; 'other_type' {0, lane}: the tenant's stream of
# that lane holds another type, which a producer wrote, and counts no waiting job), then each limit's limit, remaining and ms
# until its bucket is full again, requests first} (0s for no limit).
ENQUEUE_LANES = Script(
    "enqueue_lanes",
    LUA_ACTIVATE
    + LUA_UNREAD
    + """
local max_depth, tenant, weight = tonumber(ARGV[1]), ARGV[2], ARGV[3]
local rpm, tpm, max_waiting = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local reserve = ARGV[7] == '1'
local waiting = 0
if max_waiting > 0 then
  for i = 8, 10 do waiting = waiting + unread(KEYS[i]) end
end
-- The rate hash is the producers' to write: one of another type, or a time that is no finite
-- number, reads as a full bucket (and a key of another type is replaced), as the scheduler hash's
-- junk reads as its defaults, so that no producer's write stops another's submits.
local now, tat_r, tat_t, rate_replaced = 0, 0, 0, false
if rpm > 0 or tpm > 0 then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  local tats = redis.pcall('HMGET', KEYS[4], 'r', 't')
  if tats.err then
    if string.sub(tats.err, 1, 9) ~= 'WRONGTYPE' then return redis.error_reply(tats.err) end
    tats, rate_replaced = {}, true
  end
  tat_r, tat_t = math.max(stored(tats[1], 0), now), math.max(stored(tats[2], 0), now)
end
if weight ~= '' and unless_wrongtype(redis.pcall('HSET', KEYS[1], 'w:' .. tenant, weight), OTHER_TYPE) == OTHER_TYPE then
  redis.call('DEL', KEYS[1])  -- a scheduler hash of another type (LUA_LANES, sched_field)
  redis.call('HSET', KEYS[1], 'w:' .. tenant, weight)
end
local depths, added, reason, a, b = {}, 0, '', 0, ''
for i = 9, #ARGV, 6 do
  local lane, cost, requests, tokens = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
  local stream = KEYS[7 + lane]
  if max_depth > 0 and not depths[lane] then depths[lane] = unless_wrongtype(redis.pcall('XLEN', stream), 0) end
  local next_r, next_t = tat_r, tat_t
  if rpm > 0 then next_r = tat_r + requests * 60000 / rpm end
  if tpm > 0 then next_t = tat_t + tokens * 60000 / tpm end
  if max_depth > 0 and depths[lane] >= max_depth then reason, a, b = 'full', depths[lane], LANES[lane]
  elseif max_waiting > 0 and waiting >= max_waiting then reason, a, b = 'quota', waiting, tostring(max_waiting)
  elseif tpm > 0 and tokens > tpm then reason, a, b = 'too_large', tokens, tostring(tpm)
  elseif next_r - now > 60000 then reason, a, b = 'rate', math.ceil(next_r - now - 60000), 'requests'
  elseif next_t - now > 60000 then reason, a, b = 'rate', math.ceil(next_t - now - 60000), 'tokens'
  end
  if reason == '' and not reserve then
    local entry = {'XADD', stream, '*', 'id', ARGV[i + 4], 'v', ARGV[8], 'body', ARGV[i + 5], 'cost', cost}
    if unless_wrongtype(redis.pcall(unpack(entry)), OTHER_TYPE) == OTHER_TYPE then
      reason, a, b = 'other_type', 0, LANES[lane]
    end
  end
  if reason ~= '' then break end
  if not reserve then activate(KEYS[4 + lane], KEYS[1], KEYS[2], KEYS[3], LANES[lane], tenant) end
  if depths[lane] then depths[lane] = depths[lane] + 1 end
  waiting, tat_r, tat_t, added = waiting + 1, next_r, next_t, added + 1
end
if now > 0 and added > 0 then
  if rate_replaced then redis.call('DEL', KEYS[4]) end
  redis.call('HSET', KEYS[4], 'r', string.format('%.3f', tat_r), 't', string.format('%.3f', tat_t))
  redis.call('PEXPIRE', KEYS[4], math.ceil(math.max(tat_r, tat_t) - now) + 1000)
end
local function remaining(tat, limit)
  if limit == 0 then return 0 end
  return math.floor(limit - (tat - now) * limit / 60000 + 1e-9)
end
local function reset(tat, limit)
  if limit == 0 then return 0 end
  return math.ceil(tat - now)
end
return {added, reason, a, b, rpm, remaining(tat_r, rpm), reset(tat_r, rpm), tpm, remaining(tat_t, tpm), reset(tat_t, tpm)}
""",
)

# KEYS: the stream the job goes back to, dead, the lane's sorted set, the scheduler hash, the set
# of lane streams, the doorbell. ARGV: dead letter's entry id, job id, protocol version, body, the
# lane, the tenant ('-': none), cost ('': none, for the queue's own stream). Moves a dead letter
# back to its lane as a new entry (a fresh delivery count), in one step: a retry run twice at once
# enqueues the job once. Returns the new entry's id, or nil if the letter is gone.
REVIVE = Script(
    "revive",
    LUA_ACTIVATE
    + """
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then return false end
local entry = {'XADD', KEYS[1], '*', 'id', ARGV[2], 'v', ARGV[3], 'body', ARGV[4]}
if ARGV[7] ~= '' then
  table.insert(entry, 'cost')
  table.insert(entry, ARGV[7])
end
local id = redis.call(unpack(entry))
activate(KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[5], ARGV[6])
return id
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

# KEYS: the queue's scheduler hash. ARGV: the shard count's field, a count. Returns the count stored,
# after storing ARGV[2] where none was (first writer wins: protocol.shards.stored_or_written). A
# hash of another type (a producer may write it) holds no count: the DEL that changed its type
# took it, and sched_field makes the hash anew, as the lanes' scripts do, where an HSETNX met it.
STORE_SHARDS = Script(
    "store_shards",
    LUA_LANES
    + """
local stored = sched_field(KEYS[1], ARGV[1])
if stored then return stored end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return ARGV[2]
""",
)

PRODUCER_SCRIPTS = (
    CREATE,
    CREATE_MANY,
    CANCEL,
    FOLLOW,
    ENQUEUE,
    ENQUEUE_MANY,
    ENQUEUE_LANES,
    RETRY,
    REVIVE,
    STORE_SHARDS,
)


# -- call builders: each owns its script's keys and argument order ----------------------------------


def create(keys: Keys, job_id: str, timeout_ms: int, fingerprint: str) -> ScriptCall:
    return ScriptCall(CREATE, (keys.job(job_id),), (timeout_ms, fingerprint))


def create_many(keys: Keys, jobs: list[tuple[str, int]]) -> ScriptCall:
    """CREATE_MANY of `jobs`, (fresh id, timeout in ms) each: on one server only."""
    return ScriptCall(CREATE_MANY, tuple(keys.job(job_id) for job_id, _ in jobs), tuple(t for _, t in jobs))


def cancel(keys: Keys, job_id: str, cancelled_json: str) -> ScriptCall:
    return ScriptCall(CANCEL, job_keys(keys, job_id), (cancelled_json, CANCELLED_TTL_S))


def follow(keys: Keys, job_id: str) -> ScriptCall:
    return ScriptCall(FOLLOW, (keys.job(job_id),))


def retry(keys: Keys, job_id: str, timeout_ms: int) -> ScriptCall:
    return ScriptCall(RETRY, job_keys(keys, job_id), (timeout_ms,))


def store_shards(sched: str, field: str, count: int) -> ScriptCall:
    return ScriptCall(STORE_SHARDS, (sched,), (field, count))


def enqueue(stream: str, max_depth: int, job_id: str, body: str) -> ScriptCall:
    """ENQUEUE into `stream`, a queue's own stream; max_depth 0: no bound."""
    return ScriptCall(ENQUEUE, (stream,), (max_depth, job_id, PROTOCOL_VERSION, body))


class LaneJob(NamedTuple):
    """One job as ENQUEUE_LANES adds it: its lane, what it is charged, its id and body, the
    requests it counts against a requests-per-minute limit (0: a further choice of one request),
    and the tokens it counts against a tokens-per-minute limit (None: its cost; NewJob.tokens).
    A tuple, not a frozen dataclass, whose Python __init__ costs some 4k instructions a tenant's submit."""

    lane: str
    cost: int
    job_id: str
    body: str
    requests: int = 1
    tokens: int | None = None


@dataclass(frozen=True)
class Limits:
    """A tenant's quota settings as ENQUEUE_LANES checks them; 0: no limit. `weight` None leaves
    the scheduler's weight as it is."""

    rpm: int = 0
    tpm: int = 0
    max_waiting: int = 0
    weight: float | None = None

    @property
    def rated(self) -> bool:
        return bool(self.rpm or self.tpm)

    @property
    def any(self) -> bool:
        return bool(self.rpm or self.tpm or self.max_waiting)


NO_LIMITS = Limits()


def enqueue_lanes(
    keys: Keys,
    queue: str,
    tenant: str,
    jobs: list[LaneJob],
    max_depth: int,
    limits: Limits = NO_LIMITS,
    reserve: bool = False,
) -> ScriptCall:
    """ENQUEUE_LANES of `jobs` of `tenant` (NO_TENANT: none); `reserve`: check and count them
    against the limits, add nothing (the caller adds them to a worker's own stream)."""
    weight = "" if limits.weight is None else repr(float(limits.weight))
    head = (max_depth, tenant, weight, limits.rpm, limits.tpm, limits.max_waiting, int(reserve), PROTOCOL_VERSION)
    args: list[Any] = [*head]
    for job in jobs:  # a loop, not a generator: a frame resumed at every value of every job
        counted_tokens = job.cost if job.tokens is None else job.tokens
        args += (LANES.index(job.lane) + 1, job.cost, job.requests, counted_tokens, job.job_id, job.body)
    return ScriptCall(ENQUEUE_LANES, enqueue_lanes_keys(keys, queue, tenant), tuple(args))


# ENQUEUE_LANES' keys, by the keys' prefix, the queue and the tenant: the same ten for every job of
# a tenant's client, named once (a tenant's submit named them with 14 Python calls). Started again
# empty past ENQUEUE_LANES_KEYS_KEPT: a gateway serves tenants without end.
_ENQUEUE_LANES_KEYS: dict[tuple[str, str, str], tuple[str, ...]] = {}
ENQUEUE_LANES_KEYS_KEPT = 4096


def enqueue_lanes_keys(keys: Keys, queue: str, tenant: str) -> tuple[str, ...]:
    named = _ENQUEUE_LANES_KEYS.get((keys.prefix, queue, tenant))
    if named is None:
        named = (
            keys.scheduler(queue),
            keys.lane_streams(queue),
            keys.doorbell(queue),
            keys.rate(queue, tenant),
            *(keys.lane(queue, lane) for lane in LANES),
            *(keys.lane_stream(queue, lane, tenant) for lane in LANES),
        )
        if len(_ENQUEUE_LANES_KEYS) >= ENQUEUE_LANES_KEYS_KEPT:
            _ENQUEUE_LANES_KEYS.clear()
        _ENQUEUE_LANES_KEYS[(keys.prefix, queue, tenant)] = named
    return named


def revive(
    keys: Keys,
    queue: str,
    letter_id: str,
    job_id: str,
    version: str,
    body: str,
    lane: str = DEFAULT_LANE,
    tenant: str = NO_TENANT,
    cost: str = "",
) -> ScriptCall:
    """REVIVE of a dead letter into its lane's stream of its tenant (the queue's own stream for
    the default lane of no tenant, which takes no cost field: workers that know no lanes read it)."""
    stream = keys.lane_stream(queue, lane, tenant)
    call_keys = (
        stream,
        keys.dead(queue),
        keys.lane(queue, lane),
        keys.scheduler(queue),
        keys.lane_streams(queue),
        keys.doorbell(queue),
    )
    cost = "" if stream == keys.queue(queue) else cost
    return ScriptCall(REVIVE, call_keys, (letter_id, job_id, version, body, lane, tenant, cost))


def enqueue_many(stream: str, max_depth: int, ids_and_bodies: list[tuple[str, str]]) -> ScriptCall:
    flat = tuple(x for pair in ids_and_bodies for x in pair)
    return ScriptCall(ENQUEUE_MANY, (stream,), (max_depth, PROTOCOL_VERSION, *flat))


# -- a job's commands beside the scripts ----------------------------------------------------------


def add_fresh_create(pipe: Any, keys: Keys, job_id: str, timeout_ms: int) -> None:
    """CREATE of a job with a fresh id: without a deadline that is one HSETNX of its status, which
    costs Redis less than a script (nobody reads the reply of a fresh id's CREATE)."""
    if timeout_ms:
        create(keys, job_id, timeout_ms, "").add_to(pipe)
    else:
        pipe.execute_command("HSETNX", keys.job(job_id), "status", "queued")  # hsetnx's, one call less


def add_enqueued_flag(pipe: Any, keys: Keys, job_id: str) -> None:
    """The `enqueued` flag of a job with a request_id, once its entry is in a stream: a later
    submit of the same request_id that finds the job queued reads it (CREATE)."""
    pipe.hset(keys.job(job_id), "enqueued", "1")


def add_forget(pipe: Any, keys: Keys, job_ids: list[str]) -> None:
    """The hashes of jobs that did not go in (one DEL): a later submit of their request_id then
    creates and enqueues them again."""
    pipe.delete(*(keys.job(job_id) for job_id in job_ids))


@dataclass(frozen=True)
class PlacedEntry:
    """A submit's entry on the worker stream placement chose, as one XADD (add_placed): that stream
    has no bound to check, and ENQUEUE around the XADD cost Redis about 5 us a job more
    (bench/RESULTS.md, "The Lua of a 1-token job"). Its reply, the entry id, is an enqueue's
    (replies.parse_enqueue)."""

    stream: str
    job_id: str
    body: str
    fields: dict[str, str]

    def add_to(self, pipe: Any) -> None:
        add_placed(pipe, self.stream, self.job_id, self.body, self.fields)


def add_placed(pipe: Any, stream: str, job_id: str, body: str, fields: dict[str, str]) -> None:
    """A job's entry added to the worker stream `stream` that placement chose (XADD; no bound:
    placement puts a job there only while the worker has a free slot), with `fields`, its route
    and cost (only lane-aware workers take placed jobs)."""
    pipe.xadd(stream, {"id": job_id, "v": PROTOCOL_VERSION, "body": body, **fields})
