"""What several Batch API batches driven at once hold: the gateway's resident memory, the jobs in
Redis, and the gateway's mili_gateway_batch_in_flight_bytes. Each source tree given gets a fresh
redis-server and a gateway on a queue that no worker reads, so that every batch adds all the
lines its bounds allow and holds them; BATCHES batches of LINES lines of a PROMPT-byte chat are
created at once and watched for 20 s, then cancelled.

    python -m bench.batch_memory TREE [TREE ...]   # e.g. /tmp/bm_base (git archive of main) and .

The gateway runs with batch_in_flight_bytes 16 MiB and batch_gateway_in_flight_bytes 32 MiB (set
by its variable, which a tree without the setting ignores)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import redis

from worker.embedded_redis import EmbeddedRedis, free_port

BATCHES, LINES, PROMPT = 6, 24, 900_000
PER_BATCH, GATEWAY = 16 << 20, 32 << 20
WATCH_S = 20.0


def status_kib(pid: int, field: str) -> int:
    """A field of /proc/PID/status in KiB: VmRSS (resident now), VmHWM (its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0  # a tree without it


def input_file(batch: int) -> bytes:
    lines = []
    for i in range(LINES):
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": f"{batch}-{i} " + "x" * PROMPT}],
            "max_tokens": 4,
        }
        lines.append(
            json.dumps({"custom_id": f"{batch}-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
        )
    return ("\n".join(lines) + "\n").encode()


def measure(tree: Path) -> str:
    with EmbeddedRedis(port=free_port()) as server:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {**os.environ, "PYTHONPATH": str(tree), "MILI_BATCH_GATEWAY_IN_FLIGHT_BYTES": str(GATEWAY)}
        command = [sys.executable, "-m", "gateway", "--redis", server.url, "--host", "127.0.0.1", "--port", str(port)]
        command += ["--models", json.dumps({"m": "q"}), "--batch-in-flight-bytes", str(PER_BATCH)]
        command += ["--batch-max-file-bytes", str(100 << 20), "--batch-poll-s", "0.2"]
        gateway = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(300):
                try:
                    httpx.get(f"{url}/metrics", timeout=2)
                    break
                except httpx.TransportError:
                    time.sleep(0.1)
            r = redis.Redis.from_url(server.url)
            sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
            files = [
                sdk.files.create(file=("in.jsonl", io.BytesIO(input_file(b))), purpose="batch").id
                for b in range(BATCHES)
            ]
            rss_before = status_kib(gateway.pid, "VmRSS")
            used_before = r.info("memory")["used_memory"]
            batches = [
                sdk.batches.create(input_file_id=f, endpoint="/v1/chat/completions", completion_window="24h").id
                for f in files
            ]
            jobs = counted = 0.0
            started = time.monotonic()
            while time.monotonic() - started < WATCH_S:
                jobs = max(jobs, sum(1 for _ in r.scan_iter(match="mili:job:*", count=1000)))
                counted = max(counted, gauge(url, "mili_gateway_batch_in_flight_bytes"))
                time.sleep(0.2)
            rss_now, rss_peak = status_kib(gateway.pid, "VmRSS"), status_kib(gateway.pid, "VmHWM")
            used = r.info("memory")["used_memory"] - used_before
            for batch_id in batches:
                sdk.batches.cancel(batch_id)
            return (
                f"{tree}: gateway RSS {rss_before >> 10} MiB after the uploads, {rss_now >> 10} MiB after "
                f"{WATCH_S:.0f} s, peak (VmHWM) {rss_peak >> 10} MiB; jobs in Redis at most {jobs:.0f} "
                f"({jobs * PROMPT / 2**20:.0f} MiB of prompts), Redis used_memory +{used / 2**20:.0f} MiB; "
                f"mili_gateway_batch_in_flight_bytes at most {counted / 2**20:.1f} MiB"
            )
        finally:
            gateway.terminate()
            gateway.wait(30)


if __name__ == "__main__":
    for tree in sys.argv[1:]:
        print(measure(Path(tree).resolve()), flush=True)
