"""The Lua scripts of protocol v1 that producers run, and how any MILI component runs scripts.

Each script touches the keys of one job only (its hash, event stream and done stream) or of one
queue only (its stream and dead-letter stream): they share a hash tag, so every script is atomic
and Redis Cluster-safe. A job is born here:

    (none) --CREATE--> queued --ENQUEUE--> in the queue stream
    queued --CANCEL--> cancelled            (the worker that reads the entry just drops it)
    any --FOLLOW--> streamed flag up         (a reader of stream(): the worker publishes its tokens as they come)
    failed | (none) --RETRY--> queued --REVIVE--> in the queue stream, out of the dead-letter stream

and moves on through the worker's scripts (worker/scripts.py). Every script is safe to run
twice, because a call whose reply was lost (the connection broke after Redis ran it) is retried.

Scripts run by EVALSHA; a server that lacks one (fresh, restarted, or SCRIPT FLUSHed) answers
NOSCRIPT, which means the script did not run, so `execute` loads the scripts and sends again
only what failed.

A note on Lua: a call that is not the last expression of an argument list yields only its first
value, so `f(a, unpack(t), 'X')` passes one element of `t`. Scripts build the whole argument
table and `unpack` it last (tests/queue/test_scripts.py checks every script for this).
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from redis.commands.core import CoreCommands
from redis.exceptions import NoScriptError, ResponseError

from producer_client.cluster import is_cluster, topology_errors


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


# -- a job's keys ---------------------------------------------------------------------------------

# KEYS: job. ARGV: timeout in ms (0 or none: no deadline), the request's fingerprint ('' or none:
# none). Creates the job as queued; with a timeout, its deadline (epoch ms on Redis's clock: TIME)
# goes into the hash, so that status() reports a queued job past it as expired. Returns 1 when the
# caller should enqueue it: the job is new, or it is queued and no enqueue of it was recorded
# (`enqueued`: an earlier submit stopped half-way). 0: it exists and is enqueued, or is past
# queued. -1: it exists for another request (its fingerprint differs): a request_id is bound to
# the request that first used it. Enqueueing twice is harmless: CLAIM drops the second entry.
CREATE = Script("create", """
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

# KEYS: job. A reader of stream() follows the job: its `streamed` flag goes up, and the worker
# running it (which reads the flag with each look at the job) publishes its tokens within
# stream_interval_s from then on instead of at its checkpoints. Returns 1, or 0 (changing
# nothing) if there is no such job.
FOLLOW = Script("follow", """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], 'streamed', '1')
return 1
""")

# KEYS: job, events, done. ARGV: timeout in ms (0: no deadline). An operator retries a dead-lettered
# job: one that failed (poison), whose hash expired, or that an earlier retry left queued before its
# REVIVE. Its hash, events and done entry go, so that result() and stream() of the new run never
# see the old run's end or tokens, and the job is queued again as CREATE makes it (the deadline
# counted from now), flagged enqueued: REVIVE follows. Returns {'queued'}, or {'refused', status}
# for a job that is running or has a final result other than failed, changing nothing.
RETRY = Script("retry", """
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
""")

# -- a queue's keys -------------------------------------------------------------------------------

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

# KEYS: queue, dead. ARGV: dead letter's entry id, job id, protocol version, body. Moves a dead
# letter back to the queue as a new entry (a fresh delivery count), in one step: a retry run twice
# at once enqueues the job once. Returns the new entry's id, or nil if the letter is gone.
REVIVE = Script("revive", """
if redis.call('XDEL', KEYS[2], ARGV[1]) == 0 then return false end
return redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'v', ARGV[3], 'body', ARGV[4])
""")

# KEYS: queue. ARGV: max depth (0: no bound), protocol version, then each job's id and body.
# submit_many's ENQUEUE: adds the jobs in order while the queue holds fewer than max depth entries,
# the bound ENQUEUE keeps for one job, so a chunk that would cross it fills the queue up to it and
# adds no more. Returns {jobs added, depth after}.
ENQUEUE_MANY = Script("enqueue_many", """
local max, depth = tonumber(ARGV[1]), redis.call('XLEN', KEYS[1])
local room = (#ARGV - 2) / 2
if max > 0 then room = math.min(room, math.max(0, max - depth)) end
for i = 1, room do
  redis.call('XADD', KEYS[1], '*', 'id', ARGV[2 * i + 1], 'v', ARGV[2], 'body', ARGV[2 * i + 2])
end
return {room, depth + room}
""")

PRODUCER_SCRIPTS = (CREATE, CANCEL, FOLLOW, ENQUEUE, ENQUEUE_MANY, RETRY, REVIVE)


Stack = list[tuple[tuple, dict]]  # recorded commands: (arguments, options) each


class Commands(CoreCommands):
    """What a caller adds to a pipeline, recorded as redis-py's command methods spell it (arguments,
    and the options that parse the reply) and sent by `execute`: so the commands NOSCRIPT refused
    can be sent again, whatever kind of pipeline carried them (a cluster's stores them its own way).
    EVALSHA, TIME and the rest are recorded alike: redis-py's cluster pipeline refuses their
    methods, not the commands."""

    def __init__(self):
        self.stack: Stack = []

    def execute_command(self, *args, **options):
        self.stack.append((args, options))
        return self

    def wait_replicas(self, key: str, replicas: int, timeout_ms: int) -> Commands:
        """WAIT on the node that holds `key`, after the writes added before it: WAIT counts the
        replicas that have this connection's writes, so on a cluster it goes to that node's."""
        self.stack.append((("WAIT", replicas, timeout_ms), {_NODE_OF: key}))
        return self


# Rounds of load-and-resend for the EVALSHAs that met NOSCRIPT: a server can lose the scripts
# again between the load and the resend (two SCRIPT FLUSHes in a row, a failover after a
# failover). One that loses them every round is being flushed on purpose; its NOSCRIPT is the reply.
SCRIPT_RELOADS = 3
_NODE_OF = "mili_node_of"  # a recorded command's key whose node must run it; never sent
# Commands of several keys that answer a count: a cluster runs a command only on keys of one
# slot, so there each of these goes out once per slot of its keys, and the counts are added up
# (as redis-py's cluster client does for its own exists() and delete(), which a pipeline lacks).
COUNTED_PER_KEY = frozenset({"EXISTS", "DEL", "UNLINK", "TOUCH"})


def execute(client, add_commands: Callable, scripts: Sequence[Script] = (), raise_on_error: bool = True) -> list:
    """Record commands with `add_commands` and send them in one pipeline; on a cluster, redis-py
    splits it per node, one round trip to every node at once, and follows MOVED and ASK. A server
    that lacks our scripts (fresh, restarted, SCRIPT FLUSHed, or a replica just promoted) answers
    NOSCRIPT to each EVALSHA, which then did not run, while the pipeline's other commands did: so
    the scripts are loaded (on every master of a cluster) and only the EVALSHAs that failed are
    sent again, for up to SCRIPT_RELOADS rounds if the server loses them again. Nothing runs
    twice, which matters for commands that are not safe to repeat (an XREADGROUP sent twice would
    leave the first read's entries pending and unknown to the caller).
    With `raise_on_error=False` a command's error is its reply, for the caller to judge one by
    one; otherwise the first error is raised. `scripts`: those the pipeline may run, beside the
    producers' own."""
    commands = Commands()
    add_commands(commands)
    with topology_errors():
        replies = _send(client, commands.stack)
        for _ in range(SCRIPT_RELOADS):
            missing = _lacking_scripts(replies)
            if not missing:
                break
            load_scripts(client, scripts)
            _splice(replies, missing, _send(client, [commands.stack[i] for i in missing]))
    return _checked(replies, raise_on_error)


async def aexecute(client, add_commands: Callable, scripts: Sequence[Script] = (), raise_on_error: bool = True) -> list:
    """`execute` for a redis.asyncio client."""
    commands = Commands()
    add_commands(commands)
    with topology_errors():
        if is_cluster(client) and any(_NODE_OF in options for _, options in commands.stack):
            await client.initialize()  # the slot table, to route each WAIT to its node; once per client
        replies = await _asend(client, commands.stack)
        for _ in range(SCRIPT_RELOADS):
            missing = _lacking_scripts(replies)
            if not missing:
                break
            await aload_scripts(client, scripts)
            _splice(replies, missing, await _asend(client, [commands.stack[i] for i in missing]))
    return _checked(replies, raise_on_error)


def load_scripts(client, scripts: Sequence[Script] = ()) -> None:
    """Load the producers' scripts and `scripts`, on every master of a cluster."""
    with topology_errors():
        # The masters are named anew for each try: after a failover the old one answers no more.
        _checked(_send(client, lambda: _script_loads(client, scripts)), raise_on_error=True)


async def aload_scripts(client, scripts: Sequence[Script] = ()) -> None:
    """`load_scripts` for a redis.asyncio client."""
    with topology_errors():
        _checked(await _asend(client, lambda: _script_loads(client, scripts)), raise_on_error=True)


def _script_loads(client, scripts: Sequence[Script]) -> Stack:
    masters = client.get_primaries() if is_cluster(client) else [None]
    return [
        (("SCRIPT LOAD", script.source), {} if node is None else {"target_nodes": node})
        for node in masters for script in (*PRODUCER_SCRIPTS, *scripts)
    ]


def _send(client, stack: Stack | Callable[[], Stack]) -> list:
    """One reply (or error) per command of `stack` (or of the stack it makes), in one pipeline: on
    a cluster, built anew for each try of the client's pacing (redis-py's own empties a pipeline
    it sent), each command routed by the topology of that try."""
    def attempt() -> list:
        pipe, parts, waits = _pipeline(client, stack() if callable(stack) else stack)
        return _judged_waits(client, _folded(pipe.execute(raise_on_error=False), parts), waits)

    return client.paced(attempt) if is_cluster(client) else attempt()


async def _asend(client, stack: Stack | Callable[[], Stack]) -> list:
    async def attempt() -> list:
        pipe, parts, waits = _pipeline(client, stack() if callable(stack) else stack)
        return _judged_waits(client, _folded(await pipe.execute(raise_on_error=False), parts), waits)

    return await client.paced(attempt) if is_cluster(client) else await attempt()


def _pipeline(client, stack: Stack):
    """A pipeline of `stack`'s commands as `client` must send them; how many went out for each
    (more than one for a command of COUNTED_PER_KEY whose keys lie in several slots); and for
    each WAIT, by its place in `stack`, its key and the node it was sent to (None: one server)."""
    pipe = client.pipeline(transaction=False)
    cluster = is_cluster(client)  # asked once: an isinstance of redis-py's cluster classes costs microseconds
    parts, waits = [], {}
    for at, (args, options) in enumerate(stack):
        if _NODE_OF in options:
            options = dict(options)
            key = options.pop(_NODE_OF)
            waits[at] = (key, client.get_node_from_key(key) if cluster else None)
            if waits[at][1] is not None:
                options["target_nodes"] = waits[at][1]
        if not cluster:
            pipe.execute_command(*args, **options)
            parts.append(1)
            continue
        sent = _as_sent(client, args, options)
        for command_args, command_options in sent:
            pipe.execute_command(*command_args, **command_options)
        parts.append(len(sent))
    return pipe, parts, waits


def _as_sent(client, args: tuple, options: dict) -> Stack:
    """The commands a cluster client sends for one recorded command."""
    if str(args[0]).upper() not in COUNTED_PER_KEY:
        return [(args, options)]
    by_slot: dict[int, list] = {}
    for key in args[1:]:
        by_slot.setdefault(client.keyslot(key), []).append(key)
    return [((args[0], *keys), options) for keys in by_slot.values()]


def _judged_waits(client, replies: list, waits: dict[int, tuple[str, object]]) -> list:
    """`replies`, with 0 (no replica confirmed anything) for each WAIT that cannot vouch for the
    writes before it: one its node refused (the node turned replica in a failover), and on a
    cluster one whose key's slot another node serves now (the writes followed MOVED there, on
    another connection, while the WAIT went to the node the topology named before). A write an
    ASK sent to the node importing its slot, in the middle of a resharding, is not seen here: the
    WAIT then speaks for the writes that stayed on its node only."""
    for at, (key, node) in waits.items():
        refused = isinstance(replies[at], ResponseError)
        if refused or (node is not None and client.get_node_from_key(key).name != node.name):
            replies[at] = 0
    return replies


def _folded(replies: list, parts: list[int]) -> list:
    """The replies of the commands `_pipeline` split, one per command of the stack again: the sum
    of its counts, or the first error among them."""
    folded, at = [], 0
    for count in parts:
        mine = replies[at:at + count]
        at += count
        errors = [reply for reply in mine if isinstance(reply, Exception)]
        folded.append(mine[0] if count == 1 else errors[0] if errors else sum(mine))
    return folded


def _lacking_scripts(replies: list) -> list[int]:
    return [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]


def _splice(replies: list, positions: list[int], again: list) -> None:
    for i, reply in zip(positions, again):
        replies[i] = reply


def _checked(replies: list, raise_on_error: bool) -> list:
    if raise_on_error:
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
    return replies
