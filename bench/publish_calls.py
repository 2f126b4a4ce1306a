"""What one publication of a streamed job's tokens costs Redis and the worker's sending side, by how
a round's publications are called (issue 43): each job's PUBLISH in one pipeline, PUBLISH_ROUND
calls of --round-jobs jobs, or APPEND_ROUND calls (what a worker sends for a running job's tokens
alone). --jobs running jobs publish 3 tokens each per round, --rounds rounds --step-ms apart (a GPU
step), on an embedded redis-server; with --readers xread, a reader blocked on each job's event
stream (XREAD COUNT 512 BLOCK 2000, as stream() reads), which Redis wakes at each publication; with
--readers subscribed (a connection each) or subscribed-shared (one for all, as stream() reads), a
reader subscribed to each job's channel (SSUBSCRIBE), on which the scripts publish each event of a
followed job (every job here): what delivering a publication costs Redis either way.

    python -m bench.publish_calls [--jobs 256 --rounds 100 --round-jobs 64 --readers xread] [--callgrind]

Prints, per way and repeat, redis-server's CPU per publication (from /proc: other processes on
the machine do not count) and the sending process's (building the calls, the pipeline, its replies).
With --callgrind the server runs under valgrind's callgrind, and what it prints for Redis is its
instructions per publication (its reads and replies included; the kernel's part is not counted),
which the machine's other work does not move; each round then waits for the readers to block again.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aredis

from bench.lua_costs import callgrind_wrapper
from bench.measure import cpu_seconds
from producer_client.job_stream import EVENT_BATCH
from producer_client.keys import Keys
from producer_client.protocol import worker as scripts
from producer_client.protocol.events import encode_tokens
from producer_client.waiting import MAX_BLOCK_MS
from worker.embedded_redis import EmbeddedRedis

KEYS = Keys()
TOKENS_PER_ROUND = 3
WAYS = ("PUBLISH each", "PUBLISH_ROUND", "APPEND_ROUND")
READERS = ("none", "xread", "subscribed", "subscribed-shared")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=256)
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--round-jobs", type=int, default=64, help="jobs per PUBLISH_ROUND call")
    p.add_argument("--step-ms", type=float, default=12.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--readers",
        default="none",
        choices=READERS,
        help="a reader per job: blocked on its event stream (xread), or subscribed to its channel (SSUBSCRIBE),"
        " on a connection each or on one for all (subscribed-shared)",
    )
    p.add_argument("--ways", nargs="+", default=WAYS, choices=WAYS)
    p.add_argument("--callgrind", action="store_true", help="count redis-server's instructions (valgrind)")
    p.add_argument(
        "--redis-config",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a CONFIG SET of the server's before the rounds, e.g. stream-node-max-entries 16",
    )
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="mili-publish-calls-") as folder:
        server = Server(Path(folder) if args.callgrind else None)
        try:
            for name, value in args.redis_config:
                server.client.config_set(name, value)
            for repeat in range(args.repeats):
                for way in args.ways:
                    redis_cost, sender_us = measure(server, way, f"{repeat}-{way[-4:]}", args)
                    print(f"{way:13}: redis-server {redis_cost}, sender {sender_us:6.2f} us per publication")
                    server.client.flushall()
        finally:
            server.stop()


class Server:
    """The embedded redis-server, under callgrind when given a folder for its dumps."""

    def __init__(self, callgrind: Path | None):
        self.callgrind = callgrind
        path = None
        if callgrind is not None:
            path = f"{callgrind_wrapper(callgrind).parent}:{os.environ['PATH']}"
        with patched_path(path):
            self.embedded = EmbeddedRedis().start()
        assert self.embedded.process is not None
        self.pid = self.embedded.process.pid
        self.socket = self.embedded.url.removeprefix("unix://")
        self.client = redis.Redis(unix_socket_path=self.socket, decode_responses=True)
        for script in scripts.WORKER_SCRIPTS:
            self.client.script_load(script.source)

    def stop(self) -> None:
        self.client.close()
        self.embedded.stop()

    def started(self) -> tuple[float, float]:
        if self.callgrind is not None:
            subprocess.run(["callgrind_control", "-z", str(self.pid)], capture_output=True, check=True)
        return cpu_seconds(self.pid), time.process_time()

    def spent(self, since: tuple[float, float], publications: int) -> tuple[str, float]:
        """Redis's cost per publication since `since` (instructions under callgrind, else CPU), and
        the sender's CPU per publication in microseconds."""
        sender_us = (time.process_time() - since[1]) / publications * 1e6
        if self.callgrind is None:
            return f"{(cpu_seconds(self.pid) - since[0]) / publications * 1e6:6.2f} us", sender_us
        subprocess.run(["callgrind_control", "-d", str(self.pid)], capture_output=True, check=True)
        dumps = sorted(self.callgrind.glob(f"cg.{self.pid}.*"), key=lambda p: int(p.suffix[1:]))
        totals = re.search(r"^totals: (\d+)", dumps[-1].read_text(), re.M)
        assert totals, f"no totals in {dumps[-1]}"
        return f"{int(totals.group(1)) / publications / 1000:6.1f}k instructions", sender_us


@contextlib.contextmanager
def patched_path(path: str | None):
    """PATH set to `path` (where a wrapper stands for redis-server) while the server starts."""
    before = os.environ["PATH"]
    if path is not None:
        os.environ["PATH"] = path
    try:
        yield
    finally:
        os.environ["PATH"] = before


def measure(server: Server, way: str, tag: str, args) -> tuple[str, float]:
    client = server.client
    job_ids = [f"{tag}-{i}" for i in range(args.jobs)]
    pipe = client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hset(KEYS.job(job_id), mapping={"status": "running", "run": "r1", "streamed": "1"})
    pipe.execute()
    send_round(client, job_ids, 0, "PUBLISH_ROUND", args.round_jobs)  # each job's start and first tokens
    readers = start_readers(server.socket, job_ids, args.readers) if args.readers != "none" else None
    blocking = args.readers == "xread"
    wait_blocked(client, readers if blocking else None, args.jobs)
    since = server.started()
    for n in range(1, args.rounds + 1):
        send_round(client, job_ids, n, way, args.round_jobs)
        time.sleep(args.step_ms / 1000)
        if args.callgrind:
            wait_blocked(client, readers if blocking else None, args.jobs)
    redis_cost, sender_us = server.spent(since, args.rounds * args.jobs)
    if readers is not None:
        pipe = client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.xadd(KEYS.events(job_id), {"type": "end", "data": "{}"})
            pipe.spublish(KEYS.events(job_id), "0-0 0-0 end {}")
        pipe.execute()
        readers.join(60)
    return redis_cost, sender_us


def wait_blocked(client: redis.Redis, readers: mp.Process | None, jobs: int) -> None:
    """Until every reader is blocked on its stream again (none: at once)."""
    while readers is not None and int(client.info("clients")["blocked_clients"]) < jobs:
        time.sleep(0.05)  # under callgrind each INFO counts: a few thousand instructions a round


def send_round(client: redis.Redis, job_ids: list[str], n: int, way: str, round_jobs: int) -> None:
    before, after = n * TOKENS_PER_ROUND, (n + 1) * TOKENS_PER_ROUND
    tokens = encode_tokens(list(range(before, after)), "abc", None)
    start = '{"worker":"w"}' if n == 0 else ""
    pipe = client.pipeline(transaction=False)
    if way == "APPEND_ROUND":
        appends = [(job_id, "r1", tokens, before, after) for job_id in job_ids]
        for at in range(0, len(appends), round_jobs):
            scripts.append_round(KEYS, appends[at : at + round_jobs]).add_to(pipe)
    else:
        calls = [
            scripts.publish(KEYS, job_id, "r1", start, tokens, before, after, "", "", 60, True) for job_id in job_ids
        ]
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


def start_readers(path: str, job_ids: list[str], how: str) -> mp.Process:
    ready = mp.get_context("spawn").Event()
    process = mp.get_context("spawn").Process(target=read_all, args=(path, job_ids, how, ready))
    process.start()
    if not ready.wait(60):
        raise RuntimeError("the readers did not start")
    return process


def read_all(path: str, job_ids: list[str], how: str, ready) -> None:
    async def read(client: aredis.Redis, job_id: str) -> None:
        if how == "subscribed":
            await listen(client, [job_id])
            return
        last = "0-0"
        while True:
            streams = await client.xread({KEYS.events(job_id): last}, block=MAX_BLOCK_MS, count=EVENT_BATCH)
            for _, entries in streams or []:
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
        if how == "subscribed-shared":
            tasks = [asyncio.create_task(listen(client, job_ids))]
        else:
            tasks = [asyncio.create_task(read(client, job_id)) for job_id in job_ids]
        await asyncio.sleep(1.0)  # every reader blocked on its stream
        ready.set()
        await asyncio.gather(*tasks)
        await client.aclose()

    asyncio.run(main())


async def listen(client: aredis.Redis, job_ids: list[str]) -> None:
    """One subscriber connection for the jobs' channels, until each has sent its end."""
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    await pubsub.ssubscribe(*[KEYS.events_channel(job_id) for job_id in job_ids])
    left = len(job_ids)
    while left:
        message = await pubsub.get_message(timeout=None)
        if message is not None and message["data"].split(" ", 3)[2] == "end":
            left -= 1
    await pubsub.aclose()


if __name__ == "__main__":
    main()
