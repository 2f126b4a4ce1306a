"""The one way a test waits for something another process or thread does."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout: float = 10.0, interval: float = 0.01) -> T:
    """Calls `condition` until it returns something truthy, and returns that; once `timeout`
    seconds have passed, returns its last (falsy) answer instead of raising, so that the caller
    says what was expected (`assert eventually(...), log`), or that it never came
    (`assert not eventually(...)`). `interval`: the pause between calls, longer for a probe that
    costs a connection or a request."""
    deadline = time.monotonic() + timeout
    while not (answer := condition()):
        if time.monotonic() > deadline:
            return answer
        time.sleep(interval)
    return answer
