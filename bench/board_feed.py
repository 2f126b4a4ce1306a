"""How soon the board's job page feed (/board/job/events) brings a job's text: a 16,000-token echo
job (one token a step, each published at once to a reader that follows it) is submitted while the
worker is stopped (SIGSTOP), its feed opened and read until a keep-alive shows it waits on the
queued job, then the worker goes on (SIGCONT) and every line is timed as it comes.

Per round: the share of the text that had come by the job's end, how long after the end the text
was whole, the keep-alives that came while text flowed, and each text event's delay after its
Redis entry (its SSE id is the entry's id: milliseconds of Redis's clock) to its arrival here.

An embedded redis-server, one echo worker, and one gateway per source tree given (this one, and
`--baseline` TREE), each with `--keepalive-s`; the rounds alternate between the gateways.

    python -m bench.board_feed [--baseline /tmp/base-19c] [--rounds 3] [--keepalive-s 0.2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import time
from pathlib import Path

import httpx

from bench.body_stall import start_gateway, wait_ready
from harness.processes import start_worker
from producer_client import Client
from worker.embedded_redis import EmbeddedRedis, free_port

REPO = Path(__file__).resolve().parents[1]
QUEUE = "bench-board"
PROMPT = "x" * 16000
GIVE_UP_S = 60.0


def main() -> None:
    args = parse_args()
    print(f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start")
    trees = {"this": REPO, **({"baseline": Path(args.baseline).resolve()} if args.baseline else {})}
    flags = ("--keepalive-s", str(args.keepalive_s))
    with EmbeddedRedis(port=free_port()) as server:
        worker = start_worker(server.url, QUEUE, "--max-model-len", "20000", name="bench-board")
        gateways = {name: start_gateway(server.url, tree, *flags) for name, tree in trees.items()}
        try:
            for _, url in gateways.values():
                wait_ready(url)
            worst: dict[str, float] = {}  # the slowest text event's delay after its Redis entry, of every round
            with Client(server.url, QUEUE) as client:
                client.generate("warm", max_tokens=4, timeout=120)
                for _ in range(args.rounds):
                    for tree, (_, url) in gateways.items():
                        line, slowest = one_round(client, worker, url)
                        worst[tree] = max(worst.get(tree, 0.0), slowest)
                        print(f"{tree}: {line}", flush=True)
            print_worst(worst)
        finally:
            for process in [worker, *(p for p, _ in gateways.values())]:
                process.send_signal(signal.SIGCONT)
                process.terminate()
                process.wait(timeout=60)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


def print_worst(worst: dict[str, float]) -> None:
    line = ", ".join(f"{tree} {seconds * 1000:.0f} ms" for tree, seconds in worst.items())
    ratio = f" (this / baseline: {worst['this'] / worst['baseline']:.3f})" if "baseline" in worst else ""
    print(f"the slowest text event after its Redis entry: {line}{ratio}")


def one_round(client: Client, worker, url: str) -> tuple[str, float]:
    """The round's summary, and its slowest text event's delay after its Redis entry."""
    worker.send_signal(signal.SIGSTOP)
    try:
        job_id = client.submit(PROMPT, max_tokens=len(PROMPT))
        with httpx.stream("GET", f"{url}/board/job/events", params={"id": job_id}, timeout=30) as response:
            lines = response.iter_lines()
            next(line for line in lines if line == ": keep-alive")
            worker.send_signal(signal.SIGCONT)
            timed = read_feed(lines)
    finally:
        worker.send_signal(signal.SIGCONT)
    timings = client.result(job_id, timeout=60).timings
    return summary(timed, timings.started_at, timings.finished_at)


def read_feed(lines) -> list[tuple[float, str, str]]:
    """(time.time(), kind, value) of each `text` event (its id and data) and keep-alive, to the end."""
    timed: list[tuple[float, str, str]] = []
    event_id = ""
    give_up_at = time.monotonic() + GIVE_UP_S
    for line in lines:
        now = time.time()
        if line.startswith("id: "):
            event_id = line.removeprefix("id: ")
        elif line.startswith('data: "'):
            timed.append((now, event_id, json.loads(line.removeprefix("data: "))))
        elif line == ": keep-alive":
            timed.append((now, "", ""))
        if line == "event: end" or time.monotonic() > give_up_at:
            break
    return timed


def summary(timed: list[tuple[float, str, str]], started: float, finished: float) -> tuple[str, float]:
    texts = [(at, int(event_id.split("-")[0]) / 1000, text) for at, event_id, text in timed if event_id]
    shown = sum(len(text) for _, _, text in texts)
    by_end = sum(len(text) for at, _, text in texts if at <= finished)
    first, last = texts[0][0], texts[-1][0]
    flowing = sum(1 for at, event_id, _ in timed if not event_id and first < at < last)
    delays = sorted(at - entered for at, entered, _ in texts)
    whole = f"whole {last - finished:+.2f} s after the end" if shown == len(PROMPT) else f"INCOMPLETE ({shown})"
    line = (
        f"job ran {finished - started:.2f} s; {by_end / len(PROMPT):.0%} of the text by its end, {whole}; "
        f"{flowing} keep-alives while text came; delay after the Redis entry: median "
        f"{statistics.median(delays) * 1000:.0f} ms, max {delays[-1] * 1000:.0f} ms ({len(texts)} text events)"
    )
    return line, delays[-1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="another source tree whose gateway runs alongside, to compare")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keepalive-s", type=float, default=0.2, help="the gateways' keepalive_s (tests/board's)")
    return parser.parse_args()


if __name__ == "__main__":
    main()
