"""A Lua script of the protocol and one call of it: the call carries its keys and arguments in the
order the script reads them, so a caller never counts keys or lines up ARGV itself. Beside them,
END_JOB, the Lua of a job's end that the scripts ending a job share."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from producer_client.keys import DONE_TTL_MS, Keys


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


class ScriptCall(NamedTuple):
    """One EVALSHA of `script`, built by the call builder beside the script's source. A tuple, not
    a frozen dataclass: under half the instructions to make, and every submit makes one."""

    script: Script
    keys: tuple[str, ...]
    args: tuple[str | int | float, ...] = ()

    def add_to(self, pipe: Any) -> None:
        """Add the call to a pipeline (or the commands `execution.execute` records): the EVALSHA its
        `evalsha` method records, without that method and redis-py's `_evalsha` under it (two
        Python calls of every script call: a submit's, each of a worker's)."""
        pipe.execute_command("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)


# Prepended to every script that adds to a job's event stream (through END_JOB): an event added,
# and where `published` (a stream() reader follows the job: its streamed flag is up; and every
# end) also published on the job's shard channel (Keys.events_channel: the stream's own name, so
# in its hash slot on a cluster) as "<previous id> <id> <type> <data>". A reader on the client's
# shared subscriber (producer_client/event_feed.py) takes the event from the message where the
# previous id is the last it has, and reads the stream where it is not (a message missed): one
# message is about 7k instructions of Redis's where waking a blocked XREAD is about 57k
# (bench/RESULTS.md, issue 43). The id before (`previous`) is the caller's where it knows it: the
# event it has just added, or the run's own record of its last event (the job hash's `last`, which
# every script of a run that adds an event sets: PUBLISH_JOB in protocol/worker.py); else it comes
# from the stream (XREVRANGE, which costs Redis more than the XADD: a run's first event, an end).
# SPUBLISH under pcall: a worker whose ACL user lacks the channel's rights (docs/security.md before
# this) still writes its events, its readers reading the stream.
ADD_EVENT = """
local function add_event(events, kind, data, published, previous)
  if published and not previous then
    local last = redis.call('XREVRANGE', events, '+', '-', 'COUNT', 1)[1]
    previous = last and last[1] or '0-0'
  end
  local id = redis.call('XADD', events, '*', 'type', kind, 'data', data)
  if published then redis.pcall('SPUBLISH', events, previous .. ' ' .. id .. ' ' .. kind .. ' ' .. data) end
  return id
end
"""

# Prepended to the scripts that end a job, after every check of theirs; it takes the job's keys
# (job, events, done), since PUBLISH ends several jobs in one call.
# A job's end writes what its guarantees need after it, and nothing else (docs/architecture.md,
# "What a job keeps"):
# - the hash is rewritten with `status`, the `result` JSON and the kept fields, each left out
#   where nil: `tokens` (what the runs recorded), `fingerprint` (a later submit of the same
#   request_id is checked against it) and `cancel` (status() says a cancel was asked): the result
#   is read there until `ttl`. The run token goes: past the end, the result itself tells a retried
#   final PUBLISH of the ending run from another run's (PUBLISH). A job with tokens and neither
#   of the others (every job without a request_id that nobody cancelled) gets its HSET as one
#   call, where five tables a job were built to unpack: a table costs a script about half what a
#   command does (bench/RESULTS.md, "The Lua of a 1-token job");
# - the `done` stream gets the result, and expires DONE_TTL_MS later: the readers blocked on it
#   wake, and those whose read is in flight find it; the hash serves any reader after that;
# - the event stream, where `keep` (someone streams the job: its `stream` option or a reader's
#   FOLLOW; or more than one run published to it: its trail), gets the `end` event and the TTL;
#   any other job's goes (no DEL where the caller knows it is not there: `no_events`), stream()
#   reading the result instead.
# `ttl`: seconds the hash and kept events stay (a worker's result_ttl_s; CANCELLED_TTL_S for a producer's end),
# set by PEXPIRE: the producers' ACL grants it, not EXPIRE (docs/security.md).
# `previous`: the id of the stream's last event, where the caller has just added it (ADD_EVENT).
END_JOB = (
    ADD_EVENT
    + f"""
local function end_job(job, events, done, status, result, tokens, fingerprint, cancel, keep, ttl, no_events, previous)
  redis.call('DEL', job)
  if tokens and not fingerprint and not cancel then
    redis.call('HSET', job, 'status', status, 'result', result, 'tokens', tokens)
  else
    local hash = {{'HSET', job, 'status', status, 'result', result}}
    for _, field in ipairs({{{{'tokens', tokens}}, {{'fingerprint', fingerprint}}, {{'cancel', cancel}}}}) do
      if field[2] then
        table.insert(hash, field[1])
        table.insert(hash, field[2])
      end
    end
    redis.call(unpack(hash))
  end
  redis.call('XADD', done, '*', 'data', result)
  redis.call('PEXPIRE', done, {DONE_TTL_MS})
  if keep then
    add_event(events, 'end', result, true, previous)
  elseif not no_events then
    redis.call('DEL', events)
  end
  redis.call('PEXPIRE', job, ttl * 1000)
  if keep then redis.call('PEXPIRE', events, ttl * 1000) end
end
"""
)


def job_keys(keys: Keys, job_id: str) -> tuple[str, str, str]:
    """The keys every job script takes, in order: its hash, event stream and done stream."""
    return keys.job(job_id), keys.events(job_id), keys.done(job_id)


def add_all(calls: Iterable[ScriptCall]) -> Callable[[Any], None]:
    """Adds each of `calls` to one pipeline."""

    def add(pipe: Any) -> None:
        for call in calls:
            call.add_to(pipe)

    return add
