"""A client's one subscriber connection, shared by its stream() readers: each reader's job's events
come as messages on the job's shard channel (Keys.events_channel; the scripts publish each event
they add while a reader follows the job: protocol/script.py's ADD_EVENT), where a blocked XREAD
per reader cost Redis a wake and a new read per publication, about 57k instructions against a
message's 7k (bench/RESULTS.md, issue 43).

Nothing is lost or repeated: a message carries its event's id and the id of the event before it,
and a reader (job_stream.JobStream.read_feed) takes it only where that previous id is the last
event it has. Otherwise, and after every confirmation of its channel's subscription (the first,
and each that redis-py sends again after reconnecting silently, having dropped what came
meanwhile), and after a silence of a read's block (a worker that does not publish), the reader
reads the stream itself once, without blocking, from its last event. Where the subscriber cannot
serve (a cluster, a server or user that refuses SSUBSCRIBE, a connection that fails for good), a
reader's Feed is `broken` and it reads the stream with blocking XREADs as before.

`Subscriber` serves `Client` with a thread that reads the connection; `AsyncSubscriber` serves
`AsyncClient` with a task. The Feeds and the dispatching are shared."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any, NamedTuple, cast

import redis

from producer_client import forks
from producer_client.cluster import AsyncRedis, SyncRedis, is_cluster
from producer_client.keys import Keys

POLL_S = 1.0  # the dispatcher's longest wait for a message: how soon it sees its client close
HELD = 1024  # messages a Feed holds for a reader that does not take them; then it reads the stream
REFUSALS = (redis.ResponseError,)  # SSUBSCRIBE refused (NOPERM, an unknown command): never try again


class Published(NamedTuple):
    """One event as its message carries it: "<previous id> <id> <type> <data>"."""

    previous: str
    event_id: str
    kind: str
    data: str


def parse_published(text: str) -> Published | None:
    """The event of a message; None for one of another shape (the reader then reads the stream)."""
    parts = text.split(" ", 3)
    return Published(*parts) if len(parts) == 4 else None


class Feed:
    """One stream() reader's share of the subscriber: the messages of its job not yet taken, and
    whether it must read the stream itself (`stale`: a subscription confirmed, a message out of
    order, a silence) or for good (`broken`). Written by the dispatcher, taken by the reader, under
    a lock: a flag raised between the reader's look and its reset would be lost."""

    def __init__(self, job_id: str, channel: str):
        self.job_id = job_id
        self.channel = channel
        self.lock = threading.Lock()
        self.messages: deque[Published | None] = deque()
        self.stale = False
        self.broken = False

    def push(self, message: Published | None) -> None:
        with self.lock:
            if len(self.messages) >= HELD:  # a reader that stopped reading: it reads the stream
                self.messages.clear()
                self.stale = True
            self.messages.append(message)
        self.wake()

    def mark_stale(self) -> None:
        with self.lock:
            self.stale = True
        self.wake()

    def break_off(self) -> None:
        with self.lock:
            self.broken = True
        self.wake()

    def after_fork_in_child(self) -> None:
        """A reader that the child carries on (the fork came in the middle of its stream()) reads
        its stream itself: its channel is subscribed to in the parent, not here."""
        self.lock = threading.Lock()  # maybe held by a thread of the parent's
        self.broken = True

    def take(self) -> tuple[list[Published | None], bool]:
        """The messages that came, and whether the stream must be read first; both reset."""
        with self.lock:
            messages, stale = list(self.messages), self.stale
            self.messages.clear()
            self.stale = False
            self.clear()
        return messages, stale

    def wake(self) -> None:
        raise NotImplementedError

    def clear(self) -> None:
        raise NotImplementedError


class ThreadFeed(Feed):
    def __init__(self, job_id: str, channel: str):
        super().__init__(job_id, channel)
        self.event = threading.Event()

    def wake(self) -> None:
        self.event.set()

    def clear(self) -> None:
        self.event.clear()

    def wait(self, seconds: float) -> None:
        """Until something comes or `seconds` pass; a silence counts as stale (see the module)."""
        if not self.event.wait(seconds):
            self.mark_stale()


class TaskFeed(Feed):
    def __init__(self, job_id: str, channel: str, loop: asyncio.AbstractEventLoop):
        super().__init__(job_id, channel)
        self.loop = loop
        self.event = asyncio.Event()

    def wake(self) -> None:
        self.event.set()  # the dispatcher is a task of the same loop

    def clear(self) -> None:
        self.event.clear()

    async def wait(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self.event.wait(), seconds)
        except TimeoutError:
            self.mark_stale()


class Feeds:
    """The Feeds of the jobs being streamed, by channel (several readers may stream one job), and
    how a message or a confirmation of the subscriber reaches them."""

    def __init__(self) -> None:
        # Reentrant: a reader's generator dropped unfinished is closed by the garbage collector,
        # in whatever thread runs, maybe one in the middle of a call here.
        self.lock = threading.RLock()
        self.by_channel: dict[str, set[Feed]] = {}
        self.leaving: set[str] = set()  # channels left by their last reader, to unsubscribe from
        self.refused = False  # SSUBSCRIBE was refused once: every reader reads the stream

    def add(self, feed: Feed) -> bool:
        """Adds `feed`; True if its channel is new (to subscribe to). A channel already subscribed
        to may have been confirmed before: the new reader reads the stream first."""
        with self.lock:
            readers = self.by_channel.setdefault(feed.channel, set())
            readers.add(feed)
            first = len(readers) == 1
        if not first:
            feed.mark_stale()
        return first

    def remove(self, feed: Feed) -> None:
        """Removes `feed`; its channel, if no reader is left, is unsubscribed from by the
        dispatcher (`to_leave`): a reader's end awaits nothing, so that it may end anywhere, even
        in the garbage collector (an asyncio generator dropped unfinished)."""
        with self.lock:
            readers = self.by_channel.get(feed.channel, set())
            if feed not in readers:
                return  # never subscribed for (a broken feed), or dropped by `fail`
            readers.discard(feed)
            if not readers:
                self.by_channel.pop(feed.channel, None)
                self.leaving.add(feed.channel)

    def to_leave(self) -> list[str]:
        """The channels left that still have no reader; called under the subscriber's lock, which
        a new reader's SSUBSCRIBE is sent under too."""
        with self.lock:
            channels = [channel for channel in self.leaving if channel not in self.by_channel]
            self.leaving.clear()
        return channels

    def of(self, channel: str) -> list[Feed]:
        with self.lock:
            return list(self.by_channel.get(channel, ()))

    def dispatch(self, message: dict[str, Any]) -> None:
        kind, channel = message["type"], message["channel"]
        if kind == "smessage":
            published = parse_published(message["data"])
            for feed in self.of(channel):
                feed.push(published)
        elif kind == "ssubscribe":
            for feed in self.of(channel):
                feed.mark_stale()

    def forked(self) -> Feeds:
        """A child's Feeds, of none of the parent's channels (the parent's readers' go on reading
        their streams themselves), read in the child alone right after the fork: its lock may be
        held by a thread of the parent's."""
        for readers in self.by_channel.values():
            for feed in readers:
                feed.after_fork_in_child()
        feeds = Feeds()
        feeds.refused = self.refused
        return feeds

    def fail(self, error: BaseException) -> None:
        """The subscriber failed: every reader reads its stream from now on."""
        if isinstance(error, REFUSALS):
            self.refused = True
        with self.lock:
            feeds = [feed for readers in self.by_channel.values() for feed in readers]
            self.by_channel.clear()
        for feed in feeds:
            feed.break_off()


class Subscriber:
    """`Client`'s subscriber: one PubSub connection and a thread reading it, made at the first
    stream() and closed with the client. redis-py sends SSUBSCRIBE under the PubSub's lock, from
    any thread, while the one thread reads (as its run_in_thread does)."""

    def __init__(self, client: SyncRedis, keys: Keys):
        self.client = client
        self.keys = keys
        self.feeds = Feeds()
        self.lock = threading.Lock()
        self.pubsub: Any = None
        self.thread: threading.Thread | None = None
        self.closed = False
        forks.reset_after_fork(self)

    def after_fork_in_child(self) -> None:
        """The parent's thread is not in the child, its connection is not the child's (dropped, it
        is closed without a shutdown: redis-py's disconnect checks the pid), and its lock may be
        held by a thread of the parent's: the child's next stream() starts its own."""
        self.lock = threading.Lock()
        self.feeds = self.feeds.forked()
        self.pubsub, self.thread = None, None

    @contextlib.contextmanager
    def follow(self, job_id: str) -> Iterator[ThreadFeed]:
        """A Feed of the job's events while the block runs; broken where the subscriber cannot serve."""
        feed = ThreadFeed(job_id, self.keys.events_channel(job_id))
        self._open(feed)
        try:
            yield feed
        finally:
            self.feeds.remove(feed)

    def _open(self, feed: Feed) -> None:
        if self.closed or self.feeds.refused or is_cluster(self.client):
            feed.break_off()
            return
        try:
            with self.lock:
                pubsub = self._started()
                if self.feeds.add(feed):
                    pubsub.ssubscribe(feed.channel)
        except redis.RedisError as error:
            self.feeds.fail(error)
            self._stop()

    def _leave(self, pubsub: Any) -> None:
        if not self.feeds.leaving:
            return
        with self.lock:
            channels = self.feeds.to_leave()
            if channels:
                pubsub.sunsubscribe(*channels)

    def _started(self) -> Any:
        if self.pubsub is None:
            self.pubsub = self.client.pubsub()  # type: ignore[no-untyped-call]
        if self.thread is None:
            self.thread = threading.Thread(target=self._run, args=(self.pubsub,), name="mili-events", daemon=True)
            self.thread.start()
        return self.pubsub

    def _run(self, pubsub: Any) -> None:
        while not self.closed and pubsub is self.pubsub:
            try:
                self._leave(pubsub)
                message = pubsub.get_message(timeout=POLL_S)
            except Exception as error:  # a refusal, or a connection redis-py's retries gave up on
                self.feeds.fail(error)
                with self.lock:
                    if pubsub is self.pubsub:
                        self._stop()
                return
            if message is not None:
                self.feeds.dispatch(message)

    def _stop(self) -> None:
        """Drops the connection (the thread ends): the next stream() makes another."""
        pubsub, self.pubsub, self.thread = self.pubsub, None, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                pubsub.close()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            thread = self.thread
            self._stop()
        if thread is not None and thread is not threading.current_thread():
            thread.join(POLL_S * 2)


class DispatcherTask(asyncio.Task[None]):
    """The task of an AsyncSubscriber, which knows it was cancelled even where the CancelledError
    never reached it. redis-py sends a command in an asyncio.wait_for, which up to Python 3.11
    returns as if no cancel had come when the cancel comes as the command is sent (the write done,
    the wait_for not yet woken): the task read on for ever. asyncio.run() cancels every task left
    once its main coroutine has ended, and waits for them: it never returned (a forked child of
    tests/queue/test_fork.py, once in a loaded CI run)."""

    cancel_asked = False

    def cancel(self, msg: Any | None = None) -> bool:
        self.cancel_asked = True
        return super().cancel(msg)

    def end_if_cancelled(self) -> None:
        """Raises the CancelledError that a send swallowed, if any: the task ends cancelled, as asked."""
        if self.cancel_asked:
            raise asyncio.CancelledError


class AsyncSubscriber:
    """`AsyncClient`'s subscriber: one PubSub connection and a task of the client's event loop
    reading it, made at the first stream() and closed with the client."""

    def __init__(self, client: AsyncRedis, keys: Keys):
        self.client = client
        self.keys = keys
        self.feeds = Feeds()
        self.lock: asyncio.Lock | None = None
        self.pubsub: Any = None
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        forks.reset_after_fork(self)

    def after_fork_in_child(self) -> None:
        """The parent's task and connection belong to the parent's event loop: set aside, never
        closed (producer_client.forks); the child's next stream(), in a loop of its own, starts
        its own. The lock, bound to the parent's loop once used, is made again."""
        forks.keep(self.pubsub, self.task)
        self.lock, self.pubsub, self.task = None, None, None
        self.feeds = self.feeds.forked()

    @contextlib.asynccontextmanager
    async def follow(self, job_id: str) -> Any:
        feed = TaskFeed(job_id, self.keys.events_channel(job_id), asyncio.get_running_loop())
        await self._open(feed)
        try:
            yield feed
        finally:
            self.feeds.remove(feed)

    def _lock(self) -> asyncio.Lock:
        if self.lock is None:
            self.lock = asyncio.Lock()
        return self.lock

    async def _open(self, feed: TaskFeed) -> None:
        if self.closed or self.feeds.refused or is_cluster(self.client):
            feed.break_off()
            return
        try:
            async with self._lock():
                if self.pubsub is None:
                    self.pubsub = self.client.pubsub()
                if self.feeds.add(feed):
                    await self.pubsub.ssubscribe(feed.channel)
                if self.task is None:
                    loop = asyncio.get_running_loop()
                    self.task = DispatcherTask(self._run(self.pubsub), loop=loop, name="mili-events")
        except redis.RedisError as error:
            self.feeds.fail(error)
            await self._stop()

    async def _leave(self, pubsub: Any) -> None:
        if not self.feeds.leaving:
            return
        async with self._lock():
            channels = self.feeds.to_leave()
            if channels:
                await pubsub.sunsubscribe(*channels)

    async def _run(self, pubsub: Any) -> None:
        task = cast(DispatcherTask, asyncio.current_task())
        while not self.closed and pubsub is self.pubsub:
            try:
                await self._leave(pubsub)
                # Past the sends that may swallow a cancel (this SUNSUBSCRIBE, and redis-py's
                # resubscription when a read reconnects): the read next would not end the task.
                task.end_if_cancelled()
                message = await pubsub.get_message(timeout=POLL_S)
            except Exception as error:  # a refusal, or a connection redis-py's retries gave up on
                self.feeds.fail(error)
                if pubsub is self.pubsub:
                    self.task = None  # this task ends here: _stop must not cancel it
                    await self._stop()
                return
            if message is not None:
                self.feeds.dispatch(message)

    async def _stop(self) -> None:
        pubsub, task, self.pubsub, self.task = self.pubsub, self.task, None, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def aclose(self) -> None:
        self.closed = True
        await self._stop()
