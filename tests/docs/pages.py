"""A page's blocks run in order (tests/docs/blocks.py says how each runs), each kind by its runner."""

from __future__ import annotations

import time
from dataclasses import dataclass

from tests.docs.blocks import Block, Kind
from tests.docs.servers import run_redis, run_server
from tests.docs.sessions import Desk, Outcome, PythonSession, ShellSession


@dataclass(frozen=True)
class Ran:
    block: Block
    outcome: Outcome
    seconds: float


def run_page(blocks: list[Block], desk: Desk) -> list[Ran]:
    """Runs the page's blocks that run (Kind.PYTHON, SHELL, SERVER, REDIS) in order, each session
    started at its first block; every block runs, also after one failed, so that one reading
    shows every failure of the page (a later one may follow from an earlier)."""
    sessions: dict[Kind, PythonSession | ShellSession] = {}
    ran = []
    try:
        for block in blocks:
            if block.kind not in RUNNERS:
                continue
            start = time.monotonic()
            outcome = RUNNERS[block.kind](block, desk, sessions)
            ran.append(Ran(block, outcome, time.monotonic() - start))
    finally:
        for session in sessions.values():
            session.close()
    return ran


def in_session(kind: Kind, session_class):
    def run(block: Block, desk: Desk, sessions: dict) -> Outcome:
        if kind not in sessions or not sessions[kind].alive():
            sessions[kind] = session_class(desk)
        return sessions[kind].run(block)

    return run


RUNNERS = {
    Kind.PYTHON: in_session(Kind.PYTHON, PythonSession),
    Kind.SHELL: in_session(Kind.SHELL, ShellSession),
    Kind.SERVER: lambda block, desk, sessions: run_server(block, desk),
    Kind.REDIS: lambda block, desk, sessions: run_redis(block, desk.servers),
}
