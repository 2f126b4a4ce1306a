"""Gateway benchmark: the latency the HTTP gateway adds over the direct client, and how many idle
streams one gateway process holds, at what cost.

An embedded redis-server (TCP), one worker on the echo engine (`--model echo`: no model, the
prompt back byte by byte) and one gateway process (`python -m gateway`). In one run it prints:

  1. latency, one job at a time: `Client.generate` (the baseline) and POST /v1/completions
     through the gateway (one kept-alive HTTP connection), alternating in one loop so that both
     see the same machine; p50 and p99 of each, what the gateway adds, and the ratio;
  2. idle streams: N streaming requests for a model whose queue has no worker yet, all held
     open for a while; the gateway's CPU per stream per second and its memory per stream while
     they wait; then a worker starts on that queue, and every stream must end with its own
     prompt as text and `data: [DONE]`.

    python -m bench.gateway [--requests 2000 --streams 1000 --hold-s 20]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client as http_client
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bench.measure import cpu_seconds, pct
from harness.processes import start_worker
from producer_client import Client
from worker.embedded_redis import EmbeddedRedis, free_port

REPO = Path(__file__).resolve().parents[1]
QUEUE = "bench-echo"
IDLE_QUEUE = "bench-idle"
IDLE_MODEL = "idle"
PROMPT = "hello world"


def main() -> None:
    args = parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    with EmbeddedRedis(port=free_port()) as server:
        processes = [start_worker(server.url, QUEUE, name="bench-echo")]
        gateway_port = free_port()
        gateway = start_gateway(server.url, gateway_port, args.keepalive_s)
        processes.append(gateway)
        try:
            url = f"http://127.0.0.1:{gateway_port}"
            wait_ready(url)
            latency(server.url, url, args.requests)
            processes.append(idle_streams(server.url, url, gateway.pid, args.streams, args.hold_s, args.keepalive_s))
        finally:
            for p in processes:
                p.terminate()
                p.wait(timeout=60)
    print(f"\nload average {os.getloadavg()[0]:.2f} at end")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="jobs of each kind in the latency loop")
    p.add_argument("--streams", type=int, default=1000, help="idle streams held open at once")
    p.add_argument("--hold-s", type=float, default=20.0, help="how long the idle streams are held")
    p.add_argument("--keepalive-s", type=float, default=5.0, help="the gateway's keep-alive interval")
    return p.parse_args()


def start_gateway(redis_url: str, port: int, keepalive_s: float) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "gateway",
        "--redis",
        redis_url,
        "--port",
        str(port),
        "--log-level",
        "WARNING",
        "--keepalive-s",
        str(keepalive_s),
        "--models",
        json.dumps({IDLE_MODEL: IDLE_QUEUE}),
    ]
    return subprocess.Popen(command, cwd=REPO)


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").json().get("models"):
                return
        except (httpx.TransportError, ValueError):
            pass
        time.sleep(0.1)
    raise SystemExit("the worker or the gateway did not start")


def latency(redis_url: str, url: str, requests: int) -> None:
    # http.client rather than httpx: its own cost per request is a fraction of httpx's, so the
    # difference measured is the gateway's, not the HTTP client's.
    body = json.dumps({"model": "echo", "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    headers = {"Content-Type": "application/json"}
    http = http_client.HTTPConnection("127.0.0.1", int(url.rsplit(":", 1)[1]))
    direct: list[float] = []
    through: list[float] = []
    with Client(redis_url, QUEUE) as client:
        for i in range(200 + requests):  # the first 200 of each warm up connections and caches
            t0 = time.perf_counter()
            client.generate(PROMPT, max_tokens=1, temperature=0.0, timeout=60)
            t1 = time.perf_counter()
            http.request("POST", "/v1/completions", body, headers)
            response = http.getresponse()
            answer = response.read()
            t2 = time.perf_counter()
            assert response.status == 200 and json.loads(answer)["choices"][0]["text"] == PROMPT[0], answer
            if i >= 200:
                direct.append(t1 - t0)
                through.append(t2 - t1)
    http.close()
    print(f"\n== latency, one job at a time ({requests} each; prompt {PROMPT!r}, max_tokens 1, echo worker) ==")
    print(f"{'':>8} {'direct client':>14} {'gateway':>10} {'added':>10} {'ratio':>7}")
    for q in (50, 99):
        d, g = pct(direct, q) * 1e3, pct(through, q) * 1e3
        print(f"{'p' + str(q):>8} {d:>11.3f} ms {g:>7.3f} ms {g - d:>7.3f} ms {g / d:>6.2f}x")


def idle_streams(
    redis_url: str, url: str, gateway_pid: int, streams: int, hold_s: float, keepalive_s: float
) -> subprocess.Popen:
    """Returns the worker it started to answer the streams."""
    return asyncio.run(_idle_streams(redis_url, url, gateway_pid, streams, hold_s, keepalive_s))


async def _idle_streams(redis_url, url, gateway_pid, streams, hold_s, keepalive_s) -> subprocess.Popen:
    opened = asyncio.Semaphore(0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=None) as http:
        rss_before = rss_bytes(gateway_pid)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(one_stream(http, f"stream {i:05d}", opened)) for i in range(streams)]
        for _ in range(streams):
            await opened.acquire()
        open_s = time.perf_counter() - t0
        open_streams = gauge(url, "mili_gateway_open_streams")
        cpu0, w0 = cpu_seconds(gateway_pid), time.perf_counter()
        await asyncio.sleep(hold_s)
        cpu1, w1 = cpu_seconds(gateway_pid), time.perf_counter()
        rss_held = rss_bytes(gateway_pid)
        worker = start_worker(redis_url, IDLE_QUEUE, name="bench-idle")
        answers = await asyncio.gather(*tasks)
    complete = sum(1 for text, keepalives in answers if text is not None)
    correct = sum(1 for i, (text, _) in enumerate(answers) if text == f"stream {i:05d}")
    keepalives = sorted(k for _, k in answers)
    print(
        f"\n== {streams} idle streams (a queue with no worker), held {hold_s:g} s, keep-alive every {keepalive_s:g} s =="
    )
    print(f"  opened in {open_s:.1f} s; the gateway reports {open_streams:.0f} open streams")
    print(
        f"  gateway CPU while they wait: {(cpu1 - cpu0) / (w1 - w0) * 100:.1f}% of a core in all, "
        f"{(cpu1 - cpu0) / (w1 - w0) / streams * 1e6:.1f} us per stream per second"
    )
    print(
        f"  gateway memory: {(rss_held - rss_before) / streams / 1024:.1f} KiB per stream ({rss_held / 2**20:.0f} MiB in all)"
    )
    print(f"  keep-alives per stream: min {keepalives[0]}, median {keepalives[len(keepalives) // 2]}")
    print(f"  then a worker answered them: {complete} streams ended with [DONE], {correct} with their own prompt")
    return worker


async def one_stream(http: httpx.AsyncClient, prompt: str, opened: asyncio.Semaphore) -> tuple[str | None, int]:
    """(the streamed text if the stream ended with [DONE], else None; keep-alives seen)."""
    body = {"model": IDLE_MODEL, "prompt": prompt, "max_tokens": 64, "stream": True}
    text, keepalives = "", 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        opened.release()
        async for line in response.aiter_lines():
            if line == ": keep-alive":
                keepalives += 1
            elif line == "data: [DONE]":
                return text, keepalives
            elif line.startswith("data: "):
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    return None, keepalives


def gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise KeyError("VmRSS")


if __name__ == "__main__":
    main()
