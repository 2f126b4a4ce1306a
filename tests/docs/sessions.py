"""Where and how the doc-test runner runs a page's blocks (tests/docs/blocks.py says which runs how),
as a user runs them after the README's set-up: in a fresh clone, its virtual environment
activated, against the documented addresses (`redis://localhost:6379/0`,
`http://localhost:8000/v1`), which port_map/sitecustomize.py sends to the test's servers in every
Python process a block starts.

- `Desk`: the page's working directory, a fresh clone's view (a symlink to each of the
  repository's entries, so that what a block writes stays out of the checkout) and its environment.
- `PythonSession` (python_session.py in a child interpreter) and `ShellSession` (one bash): one of
  each per page, so that a block sees what the page's earlier blocks defined. Server commands and
  ```redis blocks: tests/docs/servers.py."""

from __future__ import annotations

import json
import os
import selectors
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tests.docs.blocks import ROOT, Block

PORT_MAP = Path(__file__).resolve().parent / "port_map"
PYTHON_DRIVER = (Path(__file__).resolve().parent / "python_session.py").read_text()
BLOCK_TIMEOUT_S = 300.0  # a block of several jobs on the tiny model, on a loaded 2-core machine
POLL_S = 0.05
TAIL_CHARS = 3000
# The documented addresses (producer_client's DEFAULT_URL, the gateway's default port).
REDIS_PORT, GATEWAY_PORT = 6379, 8000


@dataclass(frozen=True)
class Outcome:
    ok: bool
    output: str
    detail: str = ""  # what failed, when it did

    def report(self, block: Block) -> str:
        """What whoever fixes the page needs: where, what, the block and its output's end."""
        tail = self.output[-TAIL_CHARS:]
        return (
            f"{block.where} (```{block.language}): {self.detail}\n"
            f"--- the block ---\n{block.source}--- its output (the last {TAIL_CHARS} characters) ---\n{tail}"
        )


@dataclass(frozen=True)
class Servers:
    """The test's servers behind the documented addresses."""

    redis_url: str
    redis_port: int
    gateway_port: int


class Desk:
    """Where a page's blocks run: its directory (a fresh clone's view) and its environment."""

    def __init__(self, root: Path, servers: Servers):
        self.dir = root / "clone"
        self.scratch = root / "runner"
        self.dir.mkdir(parents=True)
        self.scratch.mkdir()
        for entry in ROOT.iterdir():
            if entry.name != ".git":
                (self.dir / entry.name).symlink_to(entry)
        self.servers = servers

    def env(self, bound: Path | None = None) -> dict[str, str]:
        """A user's environment after `source .venv/bin/activate`: no MILI_* setting of the test's,
        the port map, and `bound` for a server's binds (see port_map/sitecustomize.py)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("MILI_", "PYTEST_"))}
        venv_bin = Path(sys.executable).parent
        env["VIRTUAL_ENV"] = sys.prefix
        env["PATH"] = f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PORT_MAP), env.get("PYTHONPATH")]))
        connect = {REDIS_PORT: self.servers.redis_port, GATEWAY_PORT: self.servers.gateway_port}
        env["MILI_DOC_PORT_MAP"] = json.dumps({"connect": connect, "bound": str(bound) if bound else None})
        return env

    def output_file(self, block: Block) -> Path:
        return self.scratch / f"line-{block.line}.out"


def wait_for(condition, timeout_s: float, alive) -> bool:
    """Polls until `condition()` holds (True), `alive()` stops holding or the time is up (False)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        if not alive():
            return condition()
        time.sleep(POLL_S)
    return False


class PythonSession:
    def __init__(self, desk: Desk):
        self.desk = desk
        requests_read, requests_write = os.pipe()
        replies_read, replies_write = os.pipe()
        with (desk.scratch / "python-session.log").open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-c", PYTHON_DRIVER, str(requests_read), str(replies_write)],
                cwd=desk.dir,
                env=desk.env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(requests_read, replies_write),
                start_new_session=True,
            )
        os.close(requests_read)
        os.close(replies_write)
        self.requests = os.fdopen(requests_write, "w", buffering=1)
        self.replies = os.fdopen(replies_read)

    def run(self, block: Block) -> Outcome:
        output = self.desk.output_file(block)
        request = {"page": str(block.page), "first_line": block.first_line, "source": block.source}
        self.requests.write(json.dumps({**request, "output": str(output)}) + "\n")
        reply = self.reply_within(BLOCK_TIMEOUT_S)
        text = output.read_text(errors="replace") if output.exists() else ""
        if reply is None:
            self.close()
            return Outcome(False, text, f"no answer in {BLOCK_TIMEOUT_S:g}s, or the interpreter exited")
        return Outcome(reply["ok"], text, "" if reply["ok"] else "it raised (traceback below)")

    def alive(self) -> bool:
        return self.process.poll() is None and not self.requests.closed

    def reply_within(self, timeout_s: float) -> dict | None:
        with selectors.DefaultSelector() as selector:
            selector.register(self.replies, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                return None
        line = self.replies.readline()
        return json.loads(line) if line else None

    def close(self) -> None:
        """Its requests' end ends the interpreter; what it started is stopped with it."""
        for pipe in (self.requests, self.replies):
            pipe.close()
        end_group(self.process)


# Each block is sourced into the page's one bash, so that its variables and functions stay for the
# next; every command of it runs, as when pasted into a terminal, and each one that fails (an ERR
# trap: not a test of an `if`, `&&` or `||`) is recorded with its line in the block.
SHELL_PRELUDE = r"""
set -o pipefail -o errtrace
__doc_run() {
  __doc_block=$1 __doc_failed=$3.failed
  trap '__doc_status=$? __doc_line=$LINENO
    [[ ${BASH_SOURCE[0]} == "$__doc_block" ]] &&
      echo "line $__doc_line: $BASH_COMMAND (exit $__doc_status)" >> "$__doc_failed"' ERR
  source "$1" < /dev/null > "$2" 2>&1
  trap - ERR
  : > "$3"
}
"""


class ShellSession:
    def __init__(self, desk: Desk):
        self.desk = desk
        self.process = subprocess.Popen(
            ["bash", "--norc", "--noprofile"],
            cwd=desk.dir,
            env=desk.env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.send(SHELL_PRELUDE)

    def alive(self) -> bool:
        return self.process.poll() is None

    def send(self, text: str) -> None:
        self.process.stdin.write(text)
        self.process.stdin.flush()

    def run(self, block: Block) -> Outcome:
        script = self.desk.scratch / f"line-{block.line}.sh"
        script.write_text(block.source)
        output, done = self.desk.output_file(block), self.desk.scratch / f"line-{block.line}.done"
        failed = Path(f"{done}.failed")
        self.send(f"__doc_run {shlex.quote(str(script))} {shlex.quote(str(output))} {shlex.quote(str(done))}\n")
        finished = wait_for(done.exists, BLOCK_TIMEOUT_S, lambda: self.process.poll() is None)
        text = output.read_text(errors="replace") if output.exists() else ""
        if not finished:
            how = "it ended the shell" if self.process.poll() is not None else f"no end in {BLOCK_TIMEOUT_S:g}s"
            self.close()
            return Outcome(False, text, how)
        if failed.exists():
            return Outcome(False, text, "commands failed (lines of the block):\n" + failed.read_text())
        return Outcome(True, text)

    def close(self) -> None:
        """Its input's end ends the shell; what it started is stopped with it."""
        self.process.stdin.close()
        end_group(self.process)


def end_group(process: subprocess.Popen, timeout_s: float = 10) -> None:
    """Waits for a session's process to end by itself, then kills what is left of its process group
    (what its blocks started and left running)."""
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
