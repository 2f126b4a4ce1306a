"""Operations written once for both clients. An operation that needs several round trips (read the
dead letters, then retry the ones found) is a generator: it yields a function that adds commands
to a pipeline, receives that pipeline's replies (a command's error in its place; a round trip that
failed as a whole is raised inside the generator), and returns its outcome. `run` drives it over a
redis.Redis, `arun` over a redis.asyncio.Redis, so `Client` and `AsyncClient` share every line of
it. Pipelines go through `execution.execute`, which reloads scripts a server has lost (NOSCRIPT):
the producers' own, and `scripts` (another family's, such as the Batch API's).
Whatever stops a round trip is raised inside the generator, a KeyboardInterrupt or an asyncio
task's cancel too, so an operation can undo what it began (one more round trip) before it goes
on up. A step whose commands are safe to run twice says so (`Repeatable`): on a cluster, a node
that fails them in a failover then delays the step instead of failing it (execution.execute)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Sequence
from typing import Any, Protocol, TypeVar

from producer_client.cluster import AsyncRedis, SyncRedis
from producer_client.protocol import execution
from producer_client.protocol.execution import Pipe, Replies
from producer_client.protocol.script import Script

log = logging.getLogger(__name__)

T = TypeVar("T")
# Yields pipeline builders, receives each one's replies (errors in their places), returns a T. What
# a builder returns (redis-py's pipeline methods return the pipeline) is ignored.
Steps = Generator[Callable[[Pipe], object], Replies, T]


class Runner(Protocol):
    """`run` or `arun`, as the operator's views (dead letters, inspection, quotas) hold it: they
    serve both clients, so what a call returns is the outcome over a redis.Redis (run) and an
    awaitable of it over a redis.asyncio.Redis (arun): no one type says both."""

    def __call__(self, client: Any, steps: Steps[Any], /) -> Any: ...


class Repeatable:
    """A step's commands (`add`) that are safe to run twice: reads, a DEL. What `add` returns is
    ignored, as any pipeline builder's (Steps)."""

    def __init__(self, add: Callable[[Pipe], object]):
        self.add = add

    def __call__(self, pipe: Pipe) -> None:
        self.add(pipe)


def run(client: SyncRedis, steps: Steps[T], scripts: Sequence[Script] = ()) -> T:
    try:
        add = next(steps)
        while True:
            try:
                replies = execution.execute(
                    client, add, scripts, raise_on_error=False, repeatable=isinstance(add, Repeatable)
                )
            except BaseException as e:  # the round trip failed or was stopped: the operation may clean up
                add = steps.throw(e)
            else:
                add = steps.send(replies)
    except StopIteration as done:
        outcome: T = done.value  # what the generator returned, a T as Steps[T] says
        return outcome


async def arun(client: AsyncRedis, steps: Steps[T], scripts: Sequence[Script] = ()) -> T:
    try:
        add = next(steps)
        while True:
            try:
                replies = await execution.aexecute(
                    client, add, scripts, raise_on_error=False, repeatable=isinstance(add, Repeatable)
                )
            except BaseException as e:
                add = steps.throw(e)
            else:
                add = steps.send(replies)
    except StopIteration as done:
        outcome: T = done.value  # what the generator returned, a T as Steps[T] says
        return outcome


def checked(replies: Replies) -> Replies:
    """`replies`, raising the first error among them: for steps that expect none."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return replies


def undoing(add: Callable[[Pipe], object], stopped: BaseException) -> Steps[None]:
    """`add`'s commands, which undo what an operation began before `stopped` stopped it (a DEL of
    what it wrote). Their failure is logged, never raised: the caller raises `stopped`, the error
    its user must see: a clean-up's refusal would hide why. (A CREATE the ACL refused wrote
    nothing, and its callers send no clean-up of it: the same ACL refuses the DEL.) (Logged, not
    a note on `stopped`: Python 3.10 has no add_note.)"""
    try:
        checked((yield add))
    except Exception as failed:
        log.warning("the clean-up after %s failed too: %s", type(stopped).__name__, failed)
