"""What one publication of a streamed job's tokens costs Redis and the worker's sending side, by how
a round's publications are called (issue 43): each job's PUBLISH in one pipeline, or PUBLISH_ROUND
calls of --round-jobs jobs. --jobs running jobs publish 3 tokens each per round, --rounds rounds
--step-ms apart (a GPU step), on an embedded redis-server; with --readers, a reader blocked on each
job's event stream (XREAD BLOCK, as stream() reads), which Redis wakes at each publication.

    python -m bench.publish_calls [--jobs 256 --rounds 100 --round-jobs 64 --readers]

Prints, per way and repeat, redis-server's CPU per publication (from /proc: other processes on
the machine do not count) and the sending process's (building the calls, the pipeline, its replies).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time

import redis
import redis.asyncio as aredis

from bench.measure import cpu_seconds
from producer_client.keys import Keys
from producer_client.protocol import worker as scripts
from producer_client.protocol.events import encode_tokens
from worker.embedded_redis import EmbeddedRedis

KEYS = Keys()
TOKENS_PER_ROUND = 3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=256)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--round-jobs", type=int, default=64, help="jobs per PUBLISH_ROUND call")
    p.add_argument("--step-ms", type=float, default=12.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--readers", action="store_true", help="a reader blocked on each job's event stream")
    args = p.parse_args()
    with EmbeddedRedis() as server:
        client = redis.Redis(unix_socket_path=socket_of(server), decode_responses=True)
        for script in scripts.WORKER_SCRIPTS:
            client.script_load(script.source)
        for repeat in range(args.repeats):
            for way in ("PUBLISH each", "PUBLISH_ROUND"):
                redis_us, sender_us = measure(server, client, way, f"{repeat}-{way[-4:]}", args)
                print(f"{way:13}: redis-server {redis_us:6.2f} us, sender {sender_us:6.2f} us per publication")
                client.flushall()
        client.close()


def socket_of(server: EmbeddedRedis) -> str:
    return server.url.removeprefix("unix://")


def measure(server: EmbeddedRedis, client: redis.Redis, way: str, tag: str, args) -> tuple[float, float]:
    job_ids = [f"{tag}-{i}" for i in range(args.jobs)]
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hset(KEYS.job(job_id), mapping={"status": "running", "run": "r1", "streamed": "1"})
    pipe.execute()
    readers = start_readers(socket_of(server), job_ids) if args.readers else None
    redis_before, sender_before = cpu_seconds(server.process.pid), time.process_time()
    for n in range(args.rounds):
        send_round(client, job_ids, n, way, args.round_jobs)
        time.sleep(args.step_ms / 1000)
    redis_s, sender_s = cpu_seconds(server.process.pid) - redis_before, time.process_time() - sender_before
    if readers is not None:
        pipe = client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xadd(KEYS.events(job_id), {"type": "end", "data": "{}"})
        pipe.execute()
        readers.join(60)
    publications = args.rounds * args.jobs
    return redis_s / publications * 1e6, sender_s / publications * 1e6


def send_round(client: redis.Redis, job_ids: list[str], n: int, way: str, round_jobs: int) -> None:
    before, after = n * TOKENS_PER_ROUND, (n + 1) * TOKENS_PER_ROUND
    tokens = encode_tokens(list(range(before, after)), "abc", None)
    start = '{"worker":"w"}' if n == 0 else ""
    calls = [scripts.publish(KEYS, job_id, "r1", start, tokens, before, after, "", "", 60, True) for job_id in job_ids]
    pipe = client.pipeline(transaction=False)
    if way == "PUBLISH each":
        for call in calls:
            call.add_to(pipe)
    else:
        for at in range(0, len(calls), round_jobs):
            scripts.publish_round(calls[at : at + round_jobs]).add_to(pipe)
    replies = pipe.execute()
    flat = [r for reply in replies for r in (reply if isinstance(reply, list) else [reply])]
    if flat != ["followed"] * len(job_ids):
        raise RuntimeError(f"unexpected replies: {flat[:3]}")


def start_readers(path: str, job_ids: list[str]) -> mp.Process:
    ready = mp.get_context("spawn").Event()
    process = mp.get_context("spawn").Process(target=read_all, args=(path, job_ids, ready))
    process.start()
    if not ready.wait(60):
        raise RuntimeError("the readers did not start")
    return process


def read_all(path: str, job_ids: list[str], ready) -> None:
    async def read(client: aredis.Redis, job_id: str) -> None:
        last = "0-0"
        while True:
            for _, entries in await client.xread({KEYS.events(job_id): last}, block=0, count=1000):
                last = entries[-1][0]
                if any(fields["type"] == "end" for _, fields in entries):
                    return

    async def main() -> None:
        pool = aredis.ConnectionPool(
            connection_class=aredis.UnixDomainSocketConnection,
            path=path,
            max_connections=len(job_ids) + 8,
            decode_responses=True,
            socket_timeout=None,
        )
        client = aredis.Redis(connection_pool=pool)
        tasks = [asyncio.create_task(read(client, job_id)) for job_id in job_ids]
        await asyncio.sleep(1.0)  # every reader blocked on its stream
        ready.set()
        await asyncio.gather(*tasks)
        await client.aclose()

    asyncio.run(main())


if __name__ == "__main__":
    main()
