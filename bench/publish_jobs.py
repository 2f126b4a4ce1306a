"""The producers and readers of one case of bench/publish.py, with a tree's own client:
`python bench/publish_jobs.py TREE URL OUT.json PARAMS_JSON` imports `producer_client` from the
source tree TREE (this branch's, or a worktree of an older commit), so that each tree's worker is
measured with the client of its own version: a reader of this branch's stream() waits on the
events an older worker does not publish, and read such a worker only at its silence reads.

It waits for the worker and warms it up, makes the readers' connections of a streamed case, prints
`ready {"client": <its producer_client's file>}`, waits for a line on stdin (the bench's CPU
readings taken), runs the case's jobs (PARAMS_JSON's
`mode`: whole or streamed, a -gpu suffix changing nothing here, or per-job), prints `done` when
they have ended (before the readings after), and writes to OUT.json the tokens (jobs, per job)
generated and, for streamed jobs, each token's (event written, read) times and each reader's start.

Nothing of the tree is imported before TREE leads sys.path (as in bench/publish_probe.py).
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable


def main() -> int:
    tree, url, out_path, params_json = sys.argv[1:]
    params = json.loads(params_json)
    # Run as a script (the baseline tree has no copy of it), so this checkout's bench/ leads
    # sys.path: the measured tree takes its place, and its client is the one imported.
    sys.path[0] = tree
    import producer_client

    wait_ready(url, params["queue"])

    def ready() -> None:
        """Tell the bench, and wait for its go (its CPU readings taken)."""
        print("ready " + json.dumps({"client": producer_client.__file__}), flush=True)
        sys.stdin.readline()

    if params["mode"] == "per-job":
        ready()
        answer: dict = {"units": run_per_job(url, params)}
    else:
        answer = run_jobs(url, params, ready)
    print("done", flush=True)
    with open(out_path, "w") as f:
        json.dump(answer, f)
    return 0


def wait_ready(url: str, queue: str) -> None:
    from producer_client import Client

    with Client(url, queue) as client:
        deadline = time.monotonic() + 120
        while not client.workers():
            if time.monotonic() > deadline:
                raise RuntimeError("the worker did not start")
            time.sleep(0.1)
        for _ in range(20):  # its connection, the scripts, the code paths
            client.generate("warm up", max_tokens=4, timeout=60)


def prompt(i: int, tokens: int) -> str:
    head = f"job {i}: "
    return head + "x" * (tokens - len(head))


def run_jobs(url: str, params: dict, ready: Callable[[], None]) -> dict:
    from producer_client import Client

    specs = [{"prompt": prompt(i, params["tokens"]), "max_tokens": params["tokens"]} for i in range(params["jobs"])]
    streamed = params["mode"].startswith("streamed")
    if streamed and params["stream_option"]:
        for spec in specs:
            spec["stream"] = True
    if streamed:
        return asyncio.run(stream_all(url, params["queue"], specs, ready))
    ready()
    with Client(url, params["queue"]) as client:
        ids = client.submit_many(specs)
        results = list(client.as_completed(ids, timeout=600))
    check(results, specs)
    return {"units": sum(r.usage.completion_tokens for r in results)}


def submit_all(url: str, queue: str, specs: list[dict]) -> list[str]:
    """The sync client's submit_many: an older tree's AsyncClient has none."""
    from producer_client import Client

    with Client(url, queue) as client:
        return client.submit_many(specs)


async def stream_all(url: str, queue: str, specs: list[dict], ready: Callable[[], None]) -> dict:
    """A reader per job on stream(), each delta's arrival time noted per token. A connection per
    reader is made before `ready`, outside the case's CPU readings: making 256 connections cost
    redis-server 30-40 ms of CPU, 0.23-0.30 us a token of the case, which is no token's publication
    (bench/RESULTS.md, a/pub10)."""
    from producer_client import AsyncClient

    client = AsyncClient(url, queue, max_connections=len(specs) + 8)
    try:
        await asyncio.gather(*(client.redis.ping() for _ in specs))
        ready()
        ids = submit_all(url, queue, specs)
        arrivals: dict[str, list[tuple[float, float]]] = {}
        starts: dict[str, float] = {}
        texts: dict[str, str] = {}

        async def read(job_id: str) -> None:
            times, text = arrivals.setdefault(job_id, []), []
            starts[job_id] = time.time()
            async for delta in client.stream(job_id, timeout=600):
                now, written = time.time(), int(delta.event_id.split("-")[0]) / 1000
                times.extend([(written, now)] * len(delta.token_ids))
                text.append(delta.text)
            texts[job_id] = "".join(text)

        await asyncio.gather(*(read(job_id) for job_id in ids))
        results = [await client.result(job_id) for job_id in ids]
    finally:
        await client.aclose()
    check(results, specs)
    for job_id, result in zip(ids, results):
        assert texts[job_id] == result.text, f"job {job_id}: the streamed deltas differ from the result"
    return {
        "units": sum(r.usage.completion_tokens for r in results),
        "arrivals": arrivals,
        "starts": starts,
    }


def check(results: list, specs: list[dict]) -> None:
    wanted = sorted(s["prompt"][: s["max_tokens"]] for s in specs)
    assert sorted(r.text for r in results) == wanted, "a job's output is not its prompt"


def run_per_job(url: str, params: dict) -> int:
    from producer_client import Client

    per_thread = params["per_job_jobs"] // params["producers"]

    def produce(client: Client) -> None:
        for _ in range(per_thread):
            client.generate("hello world", max_tokens=1, timeout=120)

    clients = [Client(url, params["queue"]) for _ in range(params["producers"])]
    threads = [threading.Thread(target=produce, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close()
    return per_thread * params["producers"]


if __name__ == "__main__":
    sys.exit(main())
