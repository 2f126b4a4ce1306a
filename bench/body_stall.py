"""The stall one large request body puts on every other client of a gateway: while a body of up
to `max_json_bytes` (4 MiB) is parsed, validated and turned into jobs, GET /health is asked every
few milliseconds from another connection, and its slowest answer is the stall (a quiet gateway
answers it in about a millisecond).

An embedded redis-server, one echo worker, and one gateway per source tree given (this one, and
`--baseline` TREE, a worktree of another commit), on the same Redis and queue: the rounds
alternate between the gateways, so that both see the same machine.

    python -m bench.body_stall [--baseline /tmp/base-015] [--rounds 3] [--bodies messages,ids]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from harness.processes import start_worker
from worker.embedded_redis import EmbeddedRedis, free_port

REPO = Path(__file__).resolve().parents[1]
QUEUE = "bench-body"
MODEL = "body"
LIMIT = 4 << 20  # the gateway's default max_json_bytes
PROBE_INTERVAL_S = 0.005
USER = {"role": "user", "content": "a"}
TOOL = {"type": "function", "function": {"name": "f"}}


def compact(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def largest(make: Callable[[int], bytes], limit: int = LIMIT) -> bytes:
    """make(n) of the largest n whose body is at most `limit` bytes."""
    low, high = 1, 2
    while len(make(high)) <= limit:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if len(make(middle)) <= limit else (low, middle)
    return make(low)


def chat(count: int, **extra) -> bytes:
    return compact({"model": MODEL, "messages": [USER] * count, "max_tokens": 1, **extra})


# Each: (route, body). The worst of each shape under the limit (or, for n=128, well under the 1 MiB
# a job's body may take, so that every choice is enqueued).
BODIES: dict[str, Callable[[], tuple[str, bytes]]] = {
    "messages": lambda: ("/v1/chat/completions", largest(chat)),
    "parts": lambda: (
        "/v1/chat/completions",
        largest(
            lambda n: compact(
                {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * n}]}
            )
        ),
    ),
    "tools": lambda: ("/v1/chat/completions", largest(lambda n: chat(1, tools=[TOOL] * n))),
    "ids": lambda: ("/v1/completions", largest(lambda n: compact({"model": MODEL, "prompt": [1] * n}))),
    "stop_ids": lambda: (
        "/v1/completions",
        largest(lambda n: compact({"model": MODEL, "prompt": "a", "stop_token_ids": [1] * n})),
    ),
    "n128": lambda: ("/v1/chat/completions", largest(lambda n: chat(n, n=128), 900_000)),
}


def main() -> None:
    args = parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    trees = {"this": REPO, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    bodies = {name: BODIES[name]() for name in args.bodies.split(",")}
    with EmbeddedRedis(port=free_port()) as server:
        worker = start_worker(server.url, QUEUE, name="bench-body")
        gateways = {name: start_gateway(server.url, tree) for name, tree in trees.items()}
        try:
            for _, url in gateways.values():
                wait_ready(url)
            run(gateways, bodies, args.rounds)
        finally:
            for process in [worker, *(p for p, _ in gateways.values())]:
                process.terminate()
                process.wait(timeout=60)


def run(gateways: dict, bodies: dict[str, tuple[str, bytes]], rounds: int) -> None:
    stalls: dict[tuple[str, str], list[float]] = {}
    for name, (path, body) in bodies.items():
        for _ in range(rounds):
            for tree, (_, url) in gateways.items():
                status, took, stall = one_round(url, path, body)
                stalls.setdefault((name, tree), []).append(stall)
                print(
                    f"{name} ({len(body)} bytes) on {tree}: {status} in {took * 1000:.0f} ms, "
                    f"/health's slowest answer meanwhile {stall * 1000:.0f} ms",
                    flush=True,
                )
    print(f"load average {os.getloadavg()[0]:.2f} at the end")
    for name in bodies:
        worst = {tree: max(stalls[name, tree]) * 1000 for tree in gateways}
        line = ", ".join(f"{tree} {ms:.0f} ms" for tree, ms in worst.items())
        ratio = f" (this / baseline: {worst['this'] / worst['baseline']:.3f})" if "baseline" in worst else ""
        print(f"{name}: the worst stall of {rounds} rounds: {line}{ratio}")


def one_round(url: str, path: str, body: bytes) -> tuple[int, float, float]:
    """(the big request's status, its time, /health's slowest answer while it ran)."""
    done = threading.Event()
    slowest = [0.0]

    def probe() -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            client.get("/health")  # the connection made before the clock runs
            while not done.is_set():
                started = time.perf_counter()
                client.get("/health")  # a 503 too: Redis's PING not answered within health_timeout_s
                slowest[0] = max(slowest[0], time.perf_counter() - started)
                time.sleep(PROBE_INTERVAL_S)

    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.2)
    started = time.perf_counter()
    response = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=600)
    took = time.perf_counter() - started
    done.set()
    prober.join()
    return response.status_code, took, slowest[0]


def start_gateway(redis_url: str, tree: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    own_python = tree / ".venv" / "bin" / "python"
    python = str(own_python) if tree != REPO and own_python.exists() else sys.executable
    command = [python, "-m", "gateway", "--redis", redis_url, "--port", str(port), "--log-level", "WARNING"]
    command += ["--models", json.dumps({MODEL: QUEUE}), *flags]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(command, cwd=tree, env=env, stdin=subprocess.DEVNULL), f"http://127.0.0.1:{port}"


def wait_ready(url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").json().get("model_loaded"):
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no gateway with a live worker at {url}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="another source tree whose gateway runs alongside, to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bodies", default=",".join(BODIES))
    return parser.parse_args()


if __name__ == "__main__":
    main()
