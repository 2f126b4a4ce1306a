"""Protocol v2 (PROTOCOL_VERSION in keys.py): the one place that says how MILI talks to Redis. Keys are named in
producer_client/keys.py; here are the Lua scripts, each beside its call builder (which owns the
script's keys and argument order), by family: `producer` (a job's birth, cancel, follow, retry, and
the queue's ENQUEUE), `worker` (claim, publish, fail, hand-over and the entries' upkeep), `batch`
(the Batch API's batches: its scripts and every other command on their keys), `files` (the Batch
API's files); `registry` (the queue index, the worker indexes and the heartbeats), `letters` (a
queue's dead letters), `consumer` (a worker's consumer group, its reads and the doorbell),
`backlog` (every stream of a queue's jobs: what each holds, waits and runs), `job_reads` (a job's
hash, done stream and events read), `tenants` (a tenant's quota settings and rate
state); `execution`, which runs them (NOSCRIPT reload,
cluster fan-out, WAIT); `replies`, what the worker's scripts and reads answer, parsed; `events`, a
job's event payloads written and read; `clock`, Redis's clock as TIME and stream entry ids give it;
`replication`, how many replicas must confirm a write (WAIT).
The worker and the gateway decide when to call a script, never how."""
