"""The fenced code blocks of README.md and docs/*.md, each with what the doc-test runner does with it
(tests/docs/test_code_blocks.py):

- ```python: run in the page's Python session, one interpreter per page, blocks in order;
- ```bash (or sh): run in the page's shell session, one bash per page; a block whose one command
  is a server (`mili-worker`, `mili-gateway`, `python -m worker`, `python -m gateway`) runs until
  the server is ready, then is stopped;
- ```redis: its commands sent to the Redis server by redis-cli;
- ```text and ```mermaid: pictures, no code;
- any block right after a line `<!-- not-run: REASON -->`: not run, for that reason (a GPU, Docker).

Anything else is a problem the runner reports, and runs nothing of: a fence with no language, a
language with no runner, a marker with no reason or with no block under it, a server command beside
others, a command that installs or sets up the machine (pip, apt, scripts/*.sh)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^ *<!--\s*not-run\s*:?(?P<reason>.*?)-->\s*$")
MARKER_START = re.compile(r"^ *<!--\s*not-run\b")
# A command that serves until stopped: the worker (but not its `demo` or `healthcheck`, which end)
# and the gateway, by console script or module, after any VAR=value assignments.
SERVER = re.compile(
    r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:\S*/)?"
    r"(?:mili-(?P<script>worker|gateway)|python3?\s+-m\s+(?P<module>worker|gateway))"
    r"(?!\s+(?:demo|healthcheck)\b)(?:\s|$)"
)


# What changes the machine the tests run on (the shared virtual environment, the system's packages):
# never run, whatever the page says; such a block must carry a not-run marker.
SETS_UP = re.compile(
    r"(?:^|[\s;&|(])(?:pip3?\s+install|-m\s+pip\s+install|apt(?:-get)?\s+install|\S*scripts/\S+\.sh)\b"
)


class Kind(str, Enum):
    PYTHON = "python"
    SHELL = "shell"
    SERVER = "server"
    REDIS = "redis"
    PICTURE = "picture"
    NOT_RUN = "not-run"


LANGUAGES = {
    "python": Kind.PYTHON,
    "bash": Kind.SHELL,
    "sh": Kind.SHELL,
    "redis": Kind.REDIS,
    "text": Kind.PICTURE,
    "mermaid": Kind.PICTURE,
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # the 1-based line of its opening fence
    language: str
    source: str
    not_run: str | None  # the marker's reason

    @property
    def where(self) -> str:
        return f"{shown(self.page)}:{self.line}"

    @property
    def first_line(self) -> int:
        """The page's line of the block's first line of code."""
        return self.line + 1

    def commands(self) -> list[str]:
        """Its shell commands: its lines joined where one ends in a backslash, less blanks and comments."""
        lines = (line.strip() for line in self.source.replace("\\\n", " ").splitlines())
        return [line for line in lines if line and not line.startswith("#")]

    def server(self) -> str | None:
        """`worker` or `gateway` when one of its commands starts one, else None."""
        for command in self.commands():
            found = SERVER.match(command)
            if found:
                return found["script"] or found["module"]
        return None

    @property
    def kind(self) -> Kind:
        """What the runner does with it; a block it cannot run has a problem() instead."""
        if self.not_run is not None:
            return Kind.NOT_RUN
        kind = LANGUAGES[self.language]
        return Kind.SERVER if kind is Kind.SHELL and self.server() else kind

    def problem(self) -> str | None:
        """Why the runner cannot run this block as it is marked, None if it can."""
        if self.not_run is not None:
            return None if self.not_run else "its not-run marker gives no reason"
        if not self.language:
            return "its fence names no language: ```python, ```bash, ```redis, or ```text for a picture"
        if self.language not in LANGUAGES:
            return f"no runner for ```{self.language}: mark it <!-- not-run: REASON --> or label it ```text"
        if LANGUAGES[self.language] is Kind.SHELL and any(SETS_UP.search(c) for c in self.commands()):
            return "it installs or sets up the machine the tests run on: mark it <!-- not-run: REASON -->"
        if LANGUAGES[self.language] is Kind.SHELL and self.server() and len(self.commands()) > 1:
            return "a server never returns: give its command a block of its own, the runner waits until it is ready"
        return None


def shown(page: Path) -> str:
    """The page's path as a reader finds it: from the repository's root."""
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def blocks_of(page: Path) -> tuple[list[Block], list[str]]:
    """The page's blocks in order, and the problems of its markers (one that marks no block)."""
    lines = page.read_text().splitlines()
    blocks, problems = [], []
    marker: tuple[int, str] | None = None
    number = 0
    while number < len(lines):
        text = lines[number]
        opening = FENCE.match(text)
        if opening:
            number = read_block(page, lines, number, opening, marker, blocks)
            marker = None
            continue
        if marker is not None and text.strip():
            problems.append(f"{shown(page)}:{marker[0]}: a not-run marker must come right before a block")
            marker = None
        if MARKER_START.match(text):
            found = MARKER.match(text)
            marker = (number + 1, found["reason"].strip() if found else "")
        number += 1
    if marker is not None:
        problems.append(f"{shown(page)}:{marker[0]}: a not-run marker must come right before a block")
    return blocks, problems


def read_block(page: Path, lines: list[str], start: int, opening: re.Match, marker, blocks: list[Block]) -> int:
    """Appends the block that opens at `start` (0-based) to `blocks`; returns the index after its
    closing fence (or the page's end: an unclosed fence runs to it, as CommonMark reads it)."""
    indent, fence = len(opening["indent"]), opening["fence"]
    closing = re.compile(rf"^ *{re.escape(fence[0])}{{{len(fence)},}}\s*$")
    end = start + 1
    while end < len(lines) and not closing.match(lines[end]):
        end += 1
    body = [line[min(indent, len(line) - len(line.lstrip(" "))) :] for line in lines[start + 1 : end]]
    info = opening["info"].strip()
    blocks.append(
        Block(
            page=page,
            line=start + 1,
            language=info.split()[0].lower() if info else "",
            source="\n".join(body) + "\n",
            not_run=marker[1] if marker is not None else None,
        )
    )
    return end + 1
