"""Every Redis key MILI uses (protocol v1), and nothing else: no other module builds a key.

The part of a key in braces is a Redis Cluster hash tag. All keys of one job share a slot
(`job`, `events`, `done`), and so do all keys of one queue (`queue`, `dead`, `workers`). That lets
the single-job Lua scripts touch a job's hash and its event stream atomically, while no
command or script ever spans a job's keys and a queue's keys. The gateway's Batch API keeps its
files and batches here too: a file's keys share its id's slot, a batch's keys its id's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from producer_client.errors import InvalidArgument

PROTOCOL_VERSION = 1
GROUP = "workers"  # the consumer group every worker of a queue reads through
DEFAULT_PREFIX = "mili"

# Job ids, request ids, queue and worker names all end up inside keys: no braces
# (they would break the hash tag), no whitespace, bounded length.
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}")


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

    def __post_init__(self):
        check_name("prefix", self.prefix)

    def queue(self, queue: str) -> str:
        """Stream of jobs, read by the consumer group `workers`: fields id, v, body."""
        return f"{self.prefix}:q:{{{queue}}}"

    def own_queue(self, queue: str, worker: str) -> str:
        """Stream of the jobs placed on one worker of the queue (cache-aware placement, see
        docs/architecture.md), read by a consumer group `workers` of its own: the same fields as
        the queue's. Its hash tag is the queue's and the worker's names joined by `|`, which no
        name holds: each worker's stream lives on a shard of its own, and no script spans it and
        the queue's keys. Under `:q:`, so the producers' ACL pattern for queues covers it."""
        return f"{self.prefix}:q:{{{queue}|{worker}}}"

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
        start event, tokens so far, cancel, enqueued and streamed flags, and the final result JSON."""
        return f"{self.prefix}:job:{{{job_id}}}"

    def events(self, job_id: str) -> str:
        """Stream of the job's events: start, tokens, end."""
        return f"{self.prefix}:ev:{{{job_id}}}"

    def done(self, job_id: str) -> str:
        """Stream that gets one entry, the job's result, when the job ends. result() blocks on
        it and wakes once, however many steps the job takes; the event stream wakes per step.
        Named under the job's key, so an ACL pattern for job keys covers it."""
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
