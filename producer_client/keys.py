"""Every Redis key MILI uses (protocol v2), and nothing else: no other module builds a key.

The part of a key in braces is a Redis Cluster hash tag. All keys of one job share a slot
(`job`, `events`, `done`), and so do all keys of one queue (`queue`, `dead`, `workers`, and the
sharing rules': each lane's and tenant's stream, the lanes' counters, the scheduler's state, the
doorbell, the rate limits). That lets the single-job Lua scripts touch a job's hash and its event
stream atomically, and one script see every tenant of a queue's lanes, while no command or script
ever spans a job's keys and a queue's keys. The gateway's Batch API keeps its files and batches
here too: a file's keys share its id's slot, a batch's keys its id's.

Two scripts name a lane's stream from its tenant inside Redis (a tenant that becomes least served
is known only there): they prepend LUA_STREAM_OF, the same rule as `Keys.lane_stream`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from producer_client.errors import InvalidArgument

PROTOCOL_VERSION = 2  # v2: a job's end leaves its hash trimmed, a short-lived `done` stream, events only where read
# How long a job's `done` stream outlives the job's end: it wakes the readers blocked on it and
# those whose read is in flight, and then goes (a one-entry stream costs about 4.4 KB, the hash
# holds the result until result_ttl_s). A reader that comes later reads the hash.
DONE_TTL_MS = 5000
# How long a job cancelled while queued keeps its hash (and kept events) when no worker reads its
# entry (a queue nobody serves, a backlog): a producer does not know the workers' result_ttl_s, and a
# worker's claim of the entry sets it. Longer than any backlog a queue should hold (the Batch API's
# window is 24 h), since a worker that reads the entry after the hash went would run the job.
CANCELLED_TTL_S = 2 * 86400
GROUP = "workers"  # the consumer group every worker of a queue reads through
DEFAULT_PREFIX = "mili"

# Job ids, request ids, queue and worker names all end up inside keys: no braces
# (they would break the hash tag), no whitespace, bounded length.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")
# A queue spread over shards (docs/architecture.md, "A queue over several shards"): shard i > 0 of
# queue `q` is the queue's whole key family named as if the queue were `q#i`. No name holds `#`,
# so no queue's keys are another's shard's.
SHARD_MARK = "#"
MAX_SHARDS = 64
# The field of the queue's scheduler hash (shard 0's) that holds its shard count, written once by
# the first worker or producer that names one (HSETNX). Absent: one shard.
SHARDS_FIELD = "shards"


# Lanes, most important first: a worker with room takes from the highest non-empty one (with the
# anti-starvation credit of docs/architecture.md). OpenAI's service_tier values name them.
LANES = ("priority", "default", "flex")
DEFAULT_LANE = "default"
# The tenant of jobs that name none: not a valid tenant name, so it clashes with none.
NO_TENANT = "-"
# A tenant names keys, ACL patterns (`...:<tenant>`) and a metric label: no ':' (a pinned ACL
# user's pattern must match its own keys only), no '@' or '#' (entry references use them). What an
# entry or a key may name: it takes the names of clients before TENANT_NAME too.
TENANT_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A tenant a client names holds no '.' either: its jobs' ids are `<tenant>.<32 hex>`, so the
# tenant ends at the id's first '.', and that is exact only without one in the name. With one,
# tenant `k0123456789ab.x` made ids that the gateway's API key k0123456789ab took for its own
# (gateway.api_keys.Tenant.owns_job), and `~mili:job:{team.*`, the pattern of a user pinned to
# tenant `team` (docs/security.md), would have matched tenant `team.b`'s jobs.
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")


def check_tenant(field: str, value: object) -> str:
    """Return `value` if it can name a tenant, else raise InvalidArgument naming `field`."""
    if not isinstance(value, str) or not TENANT_NAME.fullmatch(value):
        raise InvalidArgument(
            field, "must be 1-64 characters of letters, digits and _- starting with a letter or digit"
        )
    return value


def check_lane(field: str, value: object) -> str:
    if value not in LANES:
        raise InvalidArgument(field, f"must be one of {', '.join(LANES)}")
    return value


# The Lua twin of Keys.lane_stream: KEYS's base stream, a lane and a tenant (NO_TENANT too) to
# the stream's key. tests/queue/test_lanes.py checks that both give the same keys.
LUA_STREAM_OF = """
local function stream_of(base, lane, tenant)
  if lane == 'default' and tenant == '-' then return base end
  return base .. ':' .. lane .. ':' .. tenant
end
"""


def check_name(field: str, value: object) -> str:
    """Return `value` if it can be part of a key, else raise InvalidArgument naming `field`."""
    if not isinstance(value, str) or not NAME_PATTERN.fullmatch(value):
        raise InvalidArgument(
            field, "must be 1-128 characters of letters, digits and ._:@/- starting with a letter or digit"
        )
    return value


@dataclass(frozen=True)
class Keys:
    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_name("prefix", self.prefix)

    def queue(self, queue: str) -> str:
        """Stream of jobs, read by the consumer group `workers`: fields id, v, body."""
        return f"{self.prefix}:q:{{{queue}}}"

    @staticmethod
    def shard(queue: str, shard: int) -> str:
        """The name shard `shard` of `queue` forms its keys with: every key method that takes a
        queue, given it, names that shard's key (its stream, lanes, scheduler, doorbell, rate
        limits, dead letters) under the hash tag `{queue#shard}`; shard 0 is the queue itself."""
        return queue if shard == 0 else f"{queue}{SHARD_MARK}{shard}"

    def own_queue(self, queue: str, worker: str) -> str:
        """Stream of the jobs placed on one worker of the queue (cache-aware placement, see
        docs/architecture.md), read by a consumer group `workers` of its own: the same fields as
        the queue's. Its hash tag is the queue's and the worker's names joined by `|`, which no
        name holds: each worker's stream lives on a shard of its own, and no script spans it and
        the queue's keys. Under `:q:`, so the producers' ACL pattern for queues covers it."""
        return f"{self.prefix}:q:{{{queue}|{worker}}}"

    def lane_stream(self, queue: str, lane: str, tenant: str) -> str:
        """Stream of one lane's jobs of one tenant (NO_TENANT: jobs that name none), read by the
        consumer group `workers` (created by the first worker to read it): the queue's fields, and
        `cost`, the tokens the job is charged when read. The default lane's jobs of no tenant are the
        queue's own stream, so that producers and workers that know no lanes still meet there."""
        if lane == DEFAULT_LANE and tenant == NO_TENANT:
            return self.queue(queue)
        return f"{self.queue(queue)}:{lane}:{tenant}"

    def lane(self, queue: str, lane: str) -> str:
        """Sorted set of the lane's active tenants (those with jobs nobody has read), each scored
        by its virtual token counter: the weighted tokens it was served (docs/architecture.md)."""
        return f"{self.prefix}:lane:{{{queue}}}:{lane}"

    def scheduler(self, queue: str) -> str:
        """Hash of the lanes' shared state: the counters of tenants that went idle (`c:<lane>:<tenant>`),
        each lane's floor (`floor:<lane>`: a counter a tenant is lifted to when the lane was empty),
        each tenant's weight (`w:<tenant>`), each lower lane's anti-starvation credit (`credit:<lane>`);
        and in shard 0's, the queue's shard count (SHARDS_FIELD), where every producer may read it."""
        return f"{self.prefix}:sched:{{{queue}}}"

    def lane_streams(self, queue: str) -> str:
        """Set of `<lane>:<tenant>` of every lane stream the queue has had: where reclaims,
        statistics and dead letters find them."""
        return f"{self.prefix}:streams:{{{queue}}}"

    def doorbell(self, queue: str) -> str:
        """Stream, group `workers`: a producer that gives a lane work adds an entry, which wakes one
        idle worker blocked on it and the queue's stream (docs/architecture.md)."""
        return f"{self.prefix}:bell:{{{queue}}}"

    def rate(self, queue: str, tenant: str) -> str:
        """Hash of a tenant's rate limits on the queue (GCRA's theoretical arrival times, `r` for
        requests and `t` for tokens, ms on Redis's clock); expires once both buckets are full."""
        return f"{self.prefix}:rate:{{{queue}}}:{tenant}"

    def quota(self, tenant: str) -> str:
        """Hash of a tenant's quota settings (`max_waiting`, `rpm`, `tpm`, `weight`), written by
        `mili quota set` and read by producers, which pass them to the enqueue script."""
        return f"{self.prefix}:quota:{tenant}"

    def quotas(self) -> str:
        """Sorted set of the tenants that have quota settings, by name: `mili quota show` lists it.
        No hash tag."""
        return f"{self.prefix}:quotas"

    def dead(self, queue: str) -> str:
        """Stream of dead-lettered jobs, with the reason."""
        return f"{self.prefix}:dead:{{{queue}}}"

    def workers(self, queue: str) -> str:
        """Sorted set of the queue's workers, scored by the time of their latest heartbeat."""
        return f"{self.prefix}:workers:{{{queue}}}"

    def queues(self) -> str:
        """Sorted set of queue names, scored by the time of their latest worker heartbeat: how
        `mili stats`, the gateway and the board find every queue without scanning the keyspace.
        No hash tag: one key for the whole namespace, written in no script."""
        return f"{self.prefix}:queues"

    def job(self, job_id: str) -> str:
        """Hash: status, the claiming worker, its entry and run token, the run that published a
        start event, tokens so far, deadline, fingerprint, cancel, enqueued, streamed and resumed
        flags while the job is queued or running. Its end leaves `status`, the final `result` JSON,
        `tokens`, and `fingerprint` and `cancel` where set, for result_ttl_s (docs/architecture.md)."""
        return f"{self.prefix}:job:{{{job_id}}}"

    def events(self, job_id: str) -> str:
        """Stream of the job's events: start, tokens, end. After the job's end it is kept (with its
        `end` event, for result_ttl_s) only where someone streams the job or more than one run
        published to it; stream() of any other ended job reads the result instead."""
        return f"{self.prefix}:ev:{{{job_id}}}"

    def events_channel(self, job_id: str) -> str:
        """Shard channel (SSUBSCRIBE) on which the scripts publish each event they add to the job's
        event stream while a reader follows it (protocol/script.py's ADD_EVENT): named as the stream,
        so in its hash slot on a cluster, and granted by the stream's ACL pattern's twin (`&`)."""
        return self.events(job_id)

    def done(self, job_id: str) -> str:
        """Stream that gets one entry, the job's result, when the job ends, and expires DONE_TTL_MS
        later (the worker that ended the job deletes it then too: worker/loop/done_sweep.py):
        result() blocks on it and wakes once, however many steps the job takes; a reader
        that comes later finds the result in the hash. Named under the job's key, so an ACL
        pattern for job keys covers it."""
        return f"{self.prefix}:job:{{{job_id}}}:done"

    def worker(self, name: str) -> str:
        """Heartbeat hash of one worker, with a TTL."""
        return f"{self.prefix}:worker:{{{name}}}"

    def file(self, file_id: str) -> str:
        """Hash: an uploaded or output file's metadata (the Batch API's file object)."""
        return f"{self.prefix}:file:{{{file_id}}}"

    def file_content(self, file_id: str) -> str:
        """List: the file's text in pieces of whole lines, written and read a few at a time (RPUSH, LRANGE)."""
        return f"{self.prefix}:file:{{{file_id}}}:content"

    def files(self) -> str:
        """Sorted set of file ids by creation time: GET /v1/files lists it for an admin key. No
        hash tag."""
        return f"{self.prefix}:files"

    def files_of(self, owner: str) -> str:
        """Sorted set of the file ids one tenant (an API key) owns, by creation time: what GET
        /v1/files lists for it. No hash tag."""
        return f"{self.prefix}:files:of:{owner}"

    def batch(self, batch_id: str) -> str:
        """Hash: a batch's object (status, timestamps, request counts, file ids) and how far its
        driver has got: the lines submitted so far, the driving gateway's lease."""
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batch_input(self, batch_id: str) -> str:
        """Hash: line index -> the batch's input line, copied from its input file once validated."""
        return f"{self.prefix}:batch:{{{batch_id}}}:input"

    def batch_answered(self, batch_id: str) -> str:
        """Bitmap: bit i is set once line i is answered (SETBIT's old value: answered once)."""
        return f"{self.prefix}:batch:{{{batch_id}}}:answered"

    def batch_output(self, batch_id: str) -> str:
        """List: the answers of the lines that succeeded, in the order they ended."""
        return f"{self.prefix}:batch:{{{batch_id}}}:output"

    def batch_errors(self, batch_id: str) -> str:
        """List: the answers of the lines that failed, were cancelled or expired."""
        return f"{self.prefix}:batch:{{{batch_id}}}:errors"

    def batch_lease(self, batch_id: str) -> str:
        """String with a TTL: the gateway driving the batch now."""
        return f"{self.prefix}:batch:{{{batch_id}}}:lease"

    def batches(self) -> str:
        """Sorted set of batch ids by creation time: GET /v1/batches lists it. No hash tag."""
        return f"{self.prefix}:batches"

    def batches_of(self, owner: str) -> str:
        """Sorted set of the batch ids one tenant (an API key) created, by creation time: what
        GET /v1/batches lists for it. No hash tag."""
        return f"{self.prefix}:batches:of:{owner}"

    def batches_unfinished(self) -> str:
        """Sorted set of the batches not ended yet: where gateways look for one to drive."""
        return f"{self.prefix}:batches:unfinished"
