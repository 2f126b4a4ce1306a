"""Reads of a job's hash `mili:job:{id}` for its status and for operators' views, each a Steps
(producer_client.steps). The scripts of protocol.producer and protocol.worker write the hash: its
`status`, `tokens` generated so far, the `worker` running it, the `entry` reference of the queue
entry it was claimed from (protocol.backlog.entry_stream), its `result`..."""

from __future__ import annotations

from producer_client.keys import Keys
from producer_client.steps import Steps, checked


def job_fields(keys: Keys, job_id: str) -> Steps[tuple[dict[str, str], tuple[int, int]]]:
    """The job's hash ({}: no such job) and Redis's clock (TIME) as it was read: one round trip."""
    fields, redis_time = checked((yield lambda pipe: (pipe.hgetall(keys.job(job_id)), pipe.time())))
    return fields, redis_time


def field_of_jobs(keys: Keys, job_ids: list[str], field: str) -> Steps[list[str | None]]:
    """One field of each job's hash (None where it has none, or there is no such job)."""
    if not job_ids:
        return []
    return checked((yield lambda pipe: [pipe.hget(keys.job(job_id), field) for job_id in job_ids]))
