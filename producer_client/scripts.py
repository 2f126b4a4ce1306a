"""The Lua scripts of protocol v1. ENQUEUE touches the queue stream only; every other script
touches one job's keys only (its hash and its event stream, which share a hash tag). So each
is atomic and Redis Cluster-safe, and a job's status moves only through them:

    (client HSET/HSETNX status queued) --ENQUEUE--> in the queue stream
    queued --CLAIM--> running --PUBLISH(final)--> done | failed | cancelled | expired
    queued --CANCEL-> cancelled            (the worker that reads the entry just drops it)
    (none) --PUBLISH(final)--> failed      (an entry that never had a valid job)

Event stream entries have two fields: `type` (start | tokens | end) and `data` (JSON). A
worker publishes a job's events of one engine step in one PUBLISH call, so a reader blocked
on the stream wakes once per step, not once per event. The job's end also adds its result,
the one entry it will ever have, to its `done` stream: a reader that wants only the result
blocks there and wakes once.

Scripts run by EVALSHA; a server that lacks one (fresh, or restarted) answers NOSCRIPT,
which means the script did not run, so the caller loads the scripts and retries.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from redis.exceptions import NoScriptError


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


# KEYS: queue. ARGV: max depth (0: no bound), job id, protocol version, body.
# Returns {1, entry id}, or {0, depth} when the queue is full. Checking and adding in one
# script makes the bound exact under any number of producers; nothing is ever trimmed.
ENQUEUE = Script("enqueue", """
local max = tonumber(ARGV[1])
if max > 0 then
  local depth = redis.call('XLEN', KEYS[1])
  if depth >= max then return {0, depth} end
end
return {1, redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'v', ARGV[3], 'body', ARGV[4])}
""")

# KEYS: job, events, done. ARGV: result JSON of a cancelled job. Returns the status before the
# call, or nil if there is no such job. A queued job ends here and now; a running one
# gets the flag its worker reads every step.
CANCEL = Script("cancel", """
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
""")

# KEYS: job, events, done. ARGV: worker, entry id, result TTL seconds.
# Returns 'claimed' (run it), 'final' (it already has a result: drop the entry) or
# 'duplicate' (another entry with the same job id is running it: drop this one).
# A missing hash is claimed too: a raw XADD bypasses the client that would create it.
CLAIM = Script("claim", """
if redis.call('HEXISTS', KEYS[1], 'result') == 1 then
  for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[3]) end
  return 'final'
end
if redis.call('HGET', KEYS[1], 'status') == 'running' and redis.call('HGET', KEYS[1], 'entry') ~= ARGV[2] then
  return 'duplicate'
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1], 'entry', ARGV[2])
return 'claimed'
""")

# KEYS: job, events, done. ARGV: start JSON, tokens JSON, tokens so far, final status, result
# JSON, result TTL seconds; '' for what the step does not have.
# A job that has a result already gets nothing: 0 (a second finisher changes nothing, not
# even the event stream). Otherwise the step's events are added, and the call returns 1
# after writing the result, or the job's cancel flag ('1' or nil) while it goes on.
PUBLISH = Script("publish", """
if redis.call('HEXISTS', KEYS[1], 'result') == 1 then return 0 end
if ARGV[1] ~= '' then redis.call('XADD', KEYS[2], '*', 'type', 'start', 'data', ARGV[1]) end
if ARGV[2] ~= '' then
  redis.call('XADD', KEYS[2], '*', 'type', 'tokens', 'data', ARGV[2])
  redis.call('HSET', KEYS[1], 'tokens', ARGV[3])
end
if ARGV[4] == '' then return redis.call('HGET', KEYS[1], 'cancel') end
redis.call('HSET', KEYS[1], 'status', ARGV[4], 'result', ARGV[5], 'tokens', ARGV[3])
redis.call('XADD', KEYS[2], '*', 'type', 'end', 'data', ARGV[5])
redis.call('XADD', KEYS[3], '*', 'data', ARGV[5])
for _, key in ipairs(KEYS) do redis.call('EXPIRE', key, ARGV[6]) end
return 1
""")

ALL = (ENQUEUE, CANCEL, CLAIM, PUBLISH)


def execute(client, add_commands: Callable) -> list:
    """Build a pipeline with `add_commands` and execute it. If the server lacks our scripts
    (NOSCRIPT: none of them ran), load them all and run the pipeline once more; callers put
    only scripts and commands that are safe to repeat in such a pipeline."""
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        add_commands(pipe)
        try:
            return pipe.execute()
        except NoScriptError:
            if attempt:
                raise
            loader = client.pipeline(transaction=False)
            for script in ALL:
                loader.script_load(script.source)
            loader.execute()


async def aexecute(client, add_commands: Callable) -> list:
    """`execute` for a redis.asyncio client."""
    for attempt in range(2):
        pipe = client.pipeline(transaction=False)
        add_commands(pipe)
        try:
            return await pipe.execute()
        except NoScriptError:
            if attempt:
                raise
            loader = client.pipeline(transaction=False)
            for script in ALL:
                loader.script_load(script.source)
            await loader.execute()
