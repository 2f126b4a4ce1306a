"""What Redis holds of jobs, read the way a test checks it: a job's events and runs, a queue's
entries."""

from __future__ import annotations

import json

import redis

from producer_client.keys import GROUP, SHARDS_FIELD, Keys
from producer_client.schema import JobResult


def events(redis_client, job_id: str) -> list[tuple[str, str, dict]]:
    """(event id, type, data) of each event in the job's stream."""
    return [(event_id, f["type"], json.loads(f["data"])) for event_id, f in redis_client.xrange(Keys().events(job_id))]


def final_result(redis_client, job_id: str) -> JobResult | None:
    """The job's result, from its hash; None before its end."""
    result = redis_client.hget(Keys().job(job_id), "result")
    return None if result is None else JobResult.model_validate_json(result)


def kept_no_events(redis_client, job_id: str) -> JobResult | None:
    """The result of a job that ended without keeping its events (protocol v2: nobody streamed it
    and one run published to it, so its result holds all that run published); None for any other."""
    if redis_client.exists(Keys().events(job_id)):
        return None
    return final_result(redis_client, job_id)


def tokens_published(redis_client, job_id: str) -> list[int]:
    whole = kept_no_events(redis_client, job_id)
    if whole is not None:
        return list(whole.token_ids)
    return [t for _, kind, data in events(redis_client, job_id) if kind == "tokens" for t in data["ids"]]


def runs(redis_client, job_id: str) -> list[tuple[dict, list[int]]]:
    """Each run of the job: its start event's data (plus `at`, when Redis added the event), and
    the tokens it published. A job that kept no events had one run, the one its result names, if
    any started it."""
    whole = kept_no_events(redis_client, job_id)
    if whole is not None:
        started = whole.timings.started_at
        if started is None:
            return []
        start = {"worker": whole.worker, "started_at": started, "resumed_tokens": 0, "at": started}
        return [(start, list(whole.token_ids))]
    out: list[tuple[dict, list[int]]] = []
    for event_id, kind, data in events(redis_client, job_id):
        if kind == "start":
            out.append(({**data, "at": int(event_id.split("-")[0]) / 1000}, []))
        elif kind == "tokens":
            out[-1][1].extend(data["ids"])
    return out


def assert_one_final_result(redis_client, job_id: str) -> None:
    """The job ended once (protocol v2): its hash holds its result, its done stream (while it lives,
    DONE_TTL_MS) one entry, that result, and its events, where it kept them, one end event, their
    last, that result."""
    result = final_result(redis_client, job_id)
    assert result is not None and result.id == job_id, job_id
    assert redis_client.hget(Keys().job(job_id), "status") == result.status, job_id
    done = [JobResult.model_validate_json(f["data"]) for _, f in redis_client.xrange(Keys().done(job_id))]
    assert done in ([], [result]), job_id
    # Events a producer planted may stay beside the end: counted, not parsed.
    found = [fields for _, fields in redis_client.xrange(Keys().events(job_id))]
    kinds = [fields.get("type") for fields in found]
    assert not kinds or (kinds.count("end") == 1 and kinds[-1] == "end"), (job_id, kinds)
    assert not kinds or JobResult.model_validate_json(found[-1]["data"]) == result, job_id


def has_ended(redis_client, job_id: str) -> bool:
    """Whether the job has its result (protocol v2: in its hash, for the result TTL)."""
    return redis_client.hexists(Keys().job(job_id), "result")


def job_ids_in_queue(redis_client, queue: str) -> list[str]:
    """The job ids of the entries a queue's streams hold (its own, its lanes', its workers')."""
    return [fields["id"] for stream in queue_streams(redis_client, queue) for _, fields in redis_client.xrange(stream)]


def job_ids(redis_client) -> set[str]:
    """The keys of the jobs that exist in Redis: a request refused before its enqueue adds none.
    Compared as sets (`after <= before`): a job of an earlier test on the same server may expire
    meanwhile, which a count read as a job missing (357 == 358 in a quick lane)."""
    return set(redis_client.keys(Keys().job("*")))


def queue_streams(redis_client, queue: str) -> list[str]:
    """The queue's shared stream, its lanes' streams of each tenant, and the own stream of every
    worker in its index (cache-aware placement puts jobs there): every stream a job of the queue
    may be in."""
    keys = Keys()
    names = redis_client.zrange(keys.workers(queue), 0, -1)
    shards = [keys.shard(queue, i) for i in range(int(redis_client.hget(keys.scheduler(queue), SHARDS_FIELD) or 1))]
    streams = []
    for shard in shards:  # a queue of several shards: each shard's own stream and lane streams
        lanes = [member.split(":", 1) for member in sorted(redis_client.smembers(keys.lane_streams(shard)))]
        streams += [keys.queue(shard), *(keys.lane_stream(shard, lane, tenant) for lane, tenant in lanes)]
    return streams + [keys.own_queue(queue, name) for name in names]


def entries_added(redis_client, queue: str) -> int:
    """Entries ever added to the queue's streams (XINFO STREAM's entries-added, over them all)."""
    return sum(
        redis_client.xinfo_stream(stream)["entries-added"]
        for stream in queue_streams(redis_client, queue)
        if redis_client.exists(stream)
    )


def queue_depth(redis_client, queue: str) -> int:
    """Entries in every stream of the queue: the shared one and each worker's own."""
    return sum(redis_client.xlen(stream) for stream in queue_streams(redis_client, queue))


def queue_pending(redis_client, queue: str) -> int:
    """Entries that workers hold, over every stream of the queue (a stream or group not created
    yet holds none)."""
    pending = 0
    for stream in queue_streams(redis_client, queue):
        try:
            pending += redis_client.xpending(stream, GROUP)["pending"]
        except redis.ResponseError:
            pass
    return pending


def pending_entries(redis_client, stream: str) -> list[dict]:
    """XPENDING's rows of the stream (at most 100); none for a stream or group not created yet."""
    try:
        return redis_client.xpending_range(stream, GROUP, "-", "+", 100)
    except redis.ResponseError:
        return []
