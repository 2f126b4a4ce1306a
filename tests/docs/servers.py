"""The blocks that run outside a page's sessions (tests/docs/sessions.py): a server command, run
until its server is ready and then stopped, and a ```redis block, sent to the test's Redis."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx

from producer_client import Client
from tests.docs.blocks import Block
from tests.docs.sessions import BLOCK_TIMEOUT_S, GATEWAY_PORT, Desk, Outcome, Servers, wait_for

SERVER_READY_TIMEOUT_S = 300.0  # a worker's model load, as tests/support/workers.py waits for it
SERVER_STOP_TIMEOUT_S = 60.0  # a worker's drain


def run_server(block: Block, desk: Desk) -> Outcome:
    """Runs the block's server command until its server is ready (a worker: a new worker in the
    queue's live workers; a gateway: its documented port, bound elsewhere, answers /health), then
    stops it with SIGTERM, as an operator does: it must exit 0, or of that SIGTERM."""
    bound, log = desk.scratch / f"line-{block.line}.bound", desk.output_file(block)
    with log.open("w") as output:
        process = subprocess.Popen(
            ["bash", "-c", block.source],
            cwd=desk.dir,
            env=desk.env(bound),
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    ready = server_probe(block.server(), desk.servers, bound)
    try:
        up = wait_for(ready, SERVER_READY_TIMEOUT_S, lambda: process.poll() is None)
    finally:
        code = stop_group(process)
    text = log.read_text(errors="replace")
    if not up:
        return Outcome(False, text, f"the {block.server()} was not ready in {SERVER_READY_TIMEOUT_S:g}s (exit {code})")
    if code not in (0, -signal.SIGTERM):  # uvicorn ends a clean shutdown by raising the signal it caught again
        return Outcome(False, text, f"the {block.server()} exited {code} after SIGTERM")
    return Outcome(True, text)


def server_probe(server: str, servers: Servers, bound: Path):
    if server == "worker":
        with Client(servers.redis_url) as client:
            before = {w.name for w in client.workers()}

        def new_worker() -> bool:
            with Client(servers.redis_url) as client:
                return any(w.name not in before for w in client.workers())

        return new_worker

    def gateway_answers() -> bool:
        ports = dict(line.split() for line in bound.read_text().splitlines()) if bound.exists() else {}
        if str(GATEWAY_PORT) not in ports:
            return False
        try:
            return httpx.get(f"http://127.0.0.1:{ports[str(GATEWAY_PORT)]}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    return gateway_answers


def stop_group(process: subprocess.Popen) -> int:
    """SIGTERM to the block's processes, SIGKILL to those left after SERVER_STOP_TIMEOUT_S; the
    exit code of the block's shell (bash -c runs a lone command in its own process)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(SERVER_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode


def run_redis(block: Block, servers: Servers) -> Outcome:
    """Each command of the block through redis-cli, as typed at its prompt; an error reply fails."""
    done = subprocess.run(
        ["redis-cli", "--no-raw", "-p", str(servers.redis_port)],  # --no-raw: "(error) " before an error reply
        input=block.source,
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
        check=False,  # its exit and its replies are the outcome
    )
    output = done.stdout + done.stderr
    errors = [line for line in output.splitlines() if line.startswith("(error)")]
    if done.returncode != 0 or errors:
        return Outcome(False, output, f"redis-cli exited {done.returncode}, errors: {errors}")
    return Outcome(True, output)
