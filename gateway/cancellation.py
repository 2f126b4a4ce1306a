"""Cancelling asyncio tasks for good.

On Python 3.11, asyncio.wait_for loses a cancel that arrives just as the call it waits for
finishes: it returns the call's result instead of raising CancelledError (CPython gh-86296,
fixed in 3.12). redis-py's asyncio client sends every command through wait_for when a socket
timeout is set, as ours is, so a task cancelled while it sends a command may go on as if it had
never been cancelled: a gateway's stop waited forever for its batch driver's polling loop so.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

# A task still running this long after its cancel is cancelled again. Long enough for what a
# cancelled task does on its way out (a Redis round trip: giving a batch's lease up).
RECANCEL_S = 1.0


async def cancel_and_wait(tasks: Collection[asyncio.Future]) -> None:
    """Cancel `tasks` and return once each has ended, its outcome retrieved (so that asyncio logs
    no "exception was never retrieved")."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RECANCEL_S)
    await asyncio.gather(*tasks, return_exceptions=True)
