"""A client made before its process forks (gunicorn --preload, uWSGI, multiprocessing's "fork" start
method, Celery's prefork) serves the parent and each child: in the child, what belongs to the
parent's process is set aside before anything else runs there (os.register_at_fork), so that the
child connects afresh and starts its own threads. A thread of the parent's is not in the child, and
a lock it held at the fork would stay held there for ever: the child's owners make new locks.

redis-py's synchronous pools see a fork themselves (their pid check). The parent's asyncio
connections are set aside but never closed, nor collected, in the child (`keep`): closing one of
them, as its StreamWriter does when collected, removes its socket from the parent's event loop's
epoll instance, which the child shares with the parent (a fork copies the descriptor, not the
instance), and the parent's loop would never hear from that socket again."""

from __future__ import annotations

import os
import weakref
from typing import Any, Protocol


class ForkAware(Protocol):
    def after_fork_in_child(self) -> None:
        """Sets aside what belongs to the parent's process: its connections, threads, tasks, locks."""


# Module-level because a fork hook is the process's, registered once for the life of the process;
# weak, so that a client closed and dropped is not kept for it.
_OWNERS: weakref.WeakSet[Any] = weakref.WeakSet()
# The parent's asyncio objects a child set aside, kept for the child's life (see the module).
_INHERITED: list[object] = []


def reset_after_fork(owner: ForkAware) -> None:
    """`owner.after_fork_in_child()` runs in each child this process forks from now on."""
    _OWNERS.add(owner)


def keep(*inherited: object) -> None:
    """Keeps the parent's asyncio objects alive in a child: never closed, never collected."""
    _INHERITED.extend(item for item in inherited if item is not None)


def _after_fork_in_child() -> None:
    for owner in list(_OWNERS):
        owner.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
