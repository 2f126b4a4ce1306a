"""What a finished job keeps in Redis (issue 43 item 1), before and after in one run: Redis's
`used_memory` per finished job, and per key of a job its type, encoding, MEMORY USAGE and TTL, for
jobs of a few sizes, read whole (`wait`) or streamed (`stream` to the end).

Each tree (this one, and with --base another checkout, say a worktree of an older commit) is
measured in a process of its own whose imports come from that tree, as is its worker: one echo
worker (`python -m worker serve --model echo`) on an embedded redis-server per case. The jobs are
submitted and read to their end, the worker has acknowledged them, and the measure waits
SETTLE_S, past the few seconds a v2 job's `done` stream outlives the job (producer_client/keys.py
DONE_TTL_MS): what is left is what every finished job costs until result_ttl_s. `at once` is the
same taken as the last result is read, the transient cost of the jobs of the last seconds included.
A streamed job is followed by its reader before its end, so v2 keeps its events.

    python -m bench.job_keys --base /tmp/base43 [--jobs 2000 --tokens 16 1 --streamed --tenant k0123456789ab]

With --tenant the jobs are that tenant's (a gateway's API key's are `k` and 12 hex digits): its
lane stream, and the ids the client makes for it, which carry it.

The measuring half imports only the client's public API, `Keys` and the embedded Redis, so that it
runs on an older tree too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUEUE = "keys"
SETTLE_S = 7.0  # past DONE_TTL_MS (5 s), and the worker's acknowledgements
TARGET_BYTES = 1024  # issue 43: memory per finished job kept, results of 16 tokens


def main() -> None:
    args = parse_args()
    if args.child:
        for tokens in args.tokens:
            for streamed in (False, True) if args.streamed else (False,):
                print(json.dumps(measure(args.jobs, tokens, streamed, args.tenant)), flush=True)
        return
    trees = {"after": ROOT} if args.base is None else {"before": Path(args.base).resolve(), "after": ROOT}
    found = {name: run_tree(tree, args) for name, tree in trees.items()}
    report(found)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="a checkout to measure beside this one (the before)")
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 1])
    p.add_argument("--streamed", action="store_true", help="also jobs read through stream() to their end")
    p.add_argument("--tenant", help="submit as this tenant (Client(tenant=...))")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def run_tree(tree: Path, args: argparse.Namespace) -> list[dict]:
    """The cases measured by a process whose imports (and whose worker's) come from `tree`."""
    argv = [__file__, "--child", "--jobs", str(args.jobs), "--tokens", *map(str, args.tokens)]
    argv += ["--streamed"] if args.streamed else []
    argv += ["--tenant", args.tenant] if args.tenant else []
    code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({__file__!r}, run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{tree}: {out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def measure(jobs: int, tokens: int, streamed: bool, tenant: str | None = None) -> dict:
    import redis

    from producer_client import Client
    from worker.embedded_redis import EmbeddedRedis, stop_process

    with EmbeddedRedis() as server, tempfile.TemporaryDirectory(prefix="mili-keys-") as logs:
        worker = start_worker(server.url, Path(logs))
        try:
            admin = redis.Redis.from_url(server.url, decode_responses=True)
            with Client(server.url, QUEUE, tenant=tenant) as client:
                client.generate("warm up", max_tokens=1, timeout=60)
                time.sleep(SETTLE_S)
                before = kept_memory(admin)
                ids = run_jobs(client, jobs, tokens, streamed)
            at_once = kept_memory(admin)
            time.sleep(SETTLE_S)
            keys = per_key(admin, ids)  # TYPE of each key also drops those that expired
            kept = kept_memory(admin)
        finally:
            stop_process(worker, 10)
    return {
        "tokens": tokens,
        "streamed": streamed,
        "jobs": jobs,
        "at_once": (at_once - before) / jobs,
        "kept": (kept - before) / jobs,
        "keys": keys,
        "protocol": protocol_version(),
    }


def protocol_version() -> int:
    from producer_client.keys import PROTOCOL_VERSION

    return PROTOCOL_VERSION


def start_worker(url: str, logs: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "worker", "serve", "--model", "echo", "--redis", url, "--queue", QUEUE]
    command += ["--metrics-port", "0", "--log-level", "WARNING", "--name", "keys-worker"]
    with open(logs / "worker.log", "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())


def run_jobs(client, jobs: int, tokens: int, streamed: bool) -> list[str]:
    """Submit the jobs (each prompt as long as its output: the echo engine stops at its prompt's
    end) and read each to its end: a hundred submitted, then each waited for; or, streamed, each
    submitted and followed at once (stream(), whose FOLLOW comes before the job's end), as a
    streaming caller does."""
    prompt = "abcdefghijklmnopqrstuvwxyz" * (tokens // 26 + 1)
    ids = []
    for start in range(0, jobs, 100):
        if streamed:
            batch = [stream_one(client, prompt, tokens) for _ in range(min(100, jobs - start))]
        else:
            batch = [client.submit(prompt, max_tokens=tokens) for _ in range(min(100, jobs - start))]
            for job_id in batch:
                check_tokens(job_id, len(client.wait(job_id, timeout=60).token_ids), tokens)
        ids += batch
    return ids


def stream_one(client, prompt: str, tokens: int) -> str:
    job_id = client.submit(prompt, max_tokens=tokens, stream=True)
    check_tokens(job_id, sum(len(d.token_ids) for d in client.stream(job_id, timeout=60)), tokens)
    return job_id


def check_tokens(job_id: str, got: int, tokens: int) -> None:
    if got != tokens:
        raise SystemExit(f"job {job_id}: {got} tokens, not {tokens}")


def kept_memory(admin) -> int:
    """used_memory less the clients' buffers, which go with their connections."""
    info = admin.info("memory")
    return info["used_memory"] - info.get("mem_clients_normal", 0)


def per_key(admin, ids: list[str]) -> dict[str, dict]:
    """For each key of a job (hash, events, done): how many jobs have it, its types and
    encodings, mean MEMORY USAGE and TTL range."""
    from producer_client.keys import Keys

    keys = Keys()
    found = {}
    for kind, key_of in {"hash": keys.job, "events": keys.events, "done": keys.done}.items():
        sizes, types, ttls = [], defaultdict(int), []
        for job_id in ids:
            key = key_of(job_id)
            kind_found = admin.type(key)
            if kind_found == "none":
                continue
            types[f"{kind_found}/{admin.object('encoding', key)}"] += 1
            sizes.append(admin.memory_usage(key, samples=0))
            ttls.append(admin.ttl(key))
        found[kind] = {
            "count": len(sizes),
            "types": dict(types),
            "memory_usage": statistics.mean(sizes) if sizes else 0,
            "ttl": [min(ttls), max(ttls)] if ttls else None,
        }
    return found


def report(found: dict[str, list[dict]]) -> None:
    for name, cases in found.items():
        print(f"\n{name} (protocol v{cases[0]['protocol']}):")
        for case in cases:
            print(f"  {label(case)}: {case['kept']:,.0f} B per finished job kept, {case['at_once']:,.0f} B at once")
            for kind, k in case["keys"].items():
                if not k["count"]:
                    print(f"    {kind:7} none")
                    continue
                types = ", ".join(f"{n} {t}" for t, n in k["types"].items())
                print(
                    f"    {kind:7} {k['count']} keys ({types}): MEMORY USAGE mean {k['memory_usage']:,.0f} B, TTL {k['ttl']}"
                )
    if "before" in found:
        print("\nkept per finished job, before -> after:")
        for before, after in zip(found["before"], found["after"]):
            verdict = ""
            if after["tokens"] == 16 and not after["streamed"]:
                verdict = f"  target <= {TARGET_BYTES} B: {'met' if after['kept'] <= TARGET_BYTES else 'missed'}"
            ratio = before["kept"] / after["kept"]
            print(
                f"  {label(after)}: {before['kept']:,.0f} B -> {after['kept']:,.0f} B ({ratio:.1f}x lighter){verdict}"
            )


def label(case: dict) -> str:
    return f"{case['tokens']}-token jobs, {'streamed' if case['streamed'] else 'read whole'}"


if __name__ == "__main__":
    main()
