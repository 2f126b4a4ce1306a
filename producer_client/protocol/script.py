"""A Lua script of protocol v1 and one call of it: the call carries its keys and arguments in the
order the script reads them, so a caller never counts keys or lines up ARGV itself."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from producer_client.keys import Keys


@dataclass(frozen=True)
class Script:
    name: str
    source: str
    sha: str = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "sha", hashlib.sha1(self.source.encode()).hexdigest())


@dataclass(frozen=True)
class ScriptCall:
    """One EVALSHA of `script`, built by the call builder beside the script's source."""

    script: Script
    keys: tuple[str, ...]
    args: tuple = ()

    def add_to(self, pipe) -> None:
        """Add the call to a pipeline (or the commands `execution.execute` records)."""
        pipe.evalsha(self.script.sha, len(self.keys), *self.keys, *self.args)


def job_keys(keys: Keys, job_id: str) -> tuple[str, str, str]:
    """The keys every job script takes, in order: its hash, event stream and done stream."""
    return keys.job(job_id), keys.events(job_id), keys.done(job_id)


def add_all(calls: Iterable[ScriptCall]) -> Callable[[Any], None]:
    """Adds each of `calls` to one pipeline."""

    def add(pipe: Any) -> None:
        for call in calls:
            call.add_to(pipe)

    return add
