"""Batch benchmark: what OpenAI's batch format costs on top of bulk jobs, with the model taken out.

Two worker processes run the echo engine (`--model echo`) on an embedded redis-server. The same
N chat requests (one token each) go through, in one run:

  1. Client.submit_many + as_completed, the jobs alone: the baseline;
  2. `mili batch` (cli.batch_file.run_batch, in this process) on a file of N lines:
     parsing, validation, submission, rendering and the answer files;
  3. the gateway's Batch API (one gateway process): upload, create, poll until completed,
     download the output file.

Each prints lines/s and its ratio to the baseline.

    python -m bench.batch [--lines 20000 --tcp]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

from bench.queue_path import QUEUE, wait_ready
from cli.batch_file import run_batch
from harness.processes import start_worker
from producer_client import Client
from worker.embedded_redis import EmbeddedRedis, free_port

CONTENT = "hello world"
MAX_TOKENS = 1


def main() -> None:
    args = parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    print(f"{args.lines:,} chat requests ({CONTENT!r}, max_tokens {MAX_TOKENS}); 2 echo workers\n")
    with EmbeddedRedis(port=free_port() if args.tcp else None) as server, tempfile.TemporaryDirectory() as tmp:
        workers = [start_worker(server.url, QUEUE, name=f"bench-worker-{i}") for i in range(2)]
        try:
            wait_ready(server.url, MAX_TOKENS)
            source = write_input(Path(tmp) / "in.jsonl", args.lines)
            base = rate(args.lines, lambda: bulk_jobs(server.url, args.lines))
            print(f"submit_many + as_completed: {base:,.0f} jobs/s")
            cli = rate(args.lines, lambda: mili_batch(server.url, source, Path(tmp)))
            print(f"mili batch: {cli:,.0f} lines/s ({cli / base:.2f}x the jobs alone)")
            gateway, gateway_url = start_gateway(server.url, args.lines)
            try:
                api = rate(args.lines, lambda: batch_api(gateway_url, source, args.lines))
            finally:
                gateway.terminate()
                gateway.wait(timeout=30)
            print(f"Batch API, one gateway: {api:,.0f} lines/s ({api / base:.2f}x the jobs alone)")
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(timeout=30)
    print(f"(load average {os.getloadavg()[0]:.2f} at end)")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lines", type=int, default=20_000)
    p.add_argument("--tcp", action="store_true", help="Redis over TCP on 127.0.0.1 instead of a unix socket")
    return p.parse_args()


def write_input(path: Path, lines: int) -> Path:
    body = {
        "model": "echo",
        "messages": [{"role": "user", "content": CONTENT}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }
    with path.open("w") as f:
        for i in range(lines):
            f.write(
                json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
            )
    return path


def rate(lines: int, run) -> float:
    t0 = time.perf_counter()
    run()
    return lines / (time.perf_counter() - t0)


def bulk_jobs(url: str, lines: int) -> None:
    with Client(url, QUEUE, max_queue_depth=None) as client:
        spec = {"messages": [{"role": "user", "content": CONTENT}], "max_tokens": MAX_TOKENS, "temperature": 0.0}
        assert sum(1 for _ in client.as_completed(client.submit_many([spec] * lines), timeout=600)) == lines


def mili_batch(url: str, source: Path, tmp: Path) -> None:
    with Client(url, QUEUE) as client:
        tally = run_batch(client, source, tmp / "out.jsonl", tmp / "out.errors.jsonl", 4096, threading.Event())
    assert tally.done == tally.lines, tally


def start_gateway(url: str, lines: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    gateway = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "--redis",
            url,
            "--port",
            str(port),
            "--log-level",
            "WARNING",
            "--batch-poll-s",
            "0.1",
            "--batch-max-file-bytes",
            str(1 << 30),
            "--batch-max-lines",
            str(lines),
        ],
        cwd=Path(__file__).resolve().parents[1],
    )
    gateway_url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{gateway_url}/metrics", timeout=1).status_code == 200:
                return gateway, gateway_url
        except httpx.TransportError:
            time.sleep(0.1)
    raise RuntimeError("the gateway did not start")


def batch_api(gateway_url: str, source: Path, lines: int) -> None:
    sdk = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    file = sdk.files.create(file=("in.jsonl", io.BytesIO(source.read_bytes())), purpose="batch")
    batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.05)
        batch = sdk.batches.retrieve(batch.id)
    assert batch.request_counts.completed == lines, batch
    assert len(sdk.files.content(batch.output_file_id).text.splitlines()) == lines


if __name__ == "__main__":
    main()
