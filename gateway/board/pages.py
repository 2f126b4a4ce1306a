"""The board's HTML: Jinja templates in templates/, autoescaped (job text, reasons and ids come
from producers and are never trusted as markup), and the filters they format numbers with."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from jinja2 import Environment, FileSystemLoader

from gateway.board.auth import SESSION_S

REFRESH_S = 1.0  # how often an open page reads the board again


def age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 10:
        return f"{max(seconds, 0.0):.1f} s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def utc(epoch_s: float | None) -> str:
    if epoch_s is None:
        return "–"
    return datetime.fromtimestamp(epoch_s, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def pretty_json(text: str) -> str:
    """A body as indented JSON; as it is, if it is not JSON (the worker fails such a job)."""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(Path(__file__).parent / "templates"), autoescape=True)
    env.filters.update(age=age, utc=utc, pretty_json=pretty_json)
    env.globals.update(refresh_ms=int(REFRESH_S * 1000), session_h=SESSION_S // 3600)
    return env
