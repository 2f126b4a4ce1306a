"""stream() over a client's one subscriber connection (producer_client/event_feed.py), with the
queue loop in this process on a real redis-server: the scripts publish each event of a followed
job on its shard channel, and the readers of one client take them there, reading the event stream
itself only after a subscription is confirmed, a message missed or a silence. Whatever happens to
the messages (the connection killed, a message dropped, none at all, a user refused the channel),
every reader's deltas are its job's result exactly, each once."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis

from harness.echo_workers import serving
from harness.polling import eventually
from producer_client import AsyncClient, Client
from producer_client.cluster import is_cluster
from producer_client.event_feed import HELD, POLL_S, Feeds, Published, Subscriber, ThreadFeed
from producer_client.job_stream import EVENT_BATCH
from producer_client.keys import Keys
from producer_client.schema import TokenDelta
from tests.support.acl import PASSWORDS, acl_commands, acl_server

pytestmark = pytest.mark.waits

KEYS = Keys()
JOBS = 4
TOKENS = 120
WAIT_S = 60
# Steps of 5 ms and a stream interval of 1 ms: about an event a token, each published.
PACE = {"step_s": 0.005, "stream_interval_s": 0.001}


def prompt(i: int) -> str:
    return (f"{i}:" + "abcdefghij" * TOKENS)[:TOKENS]


def assert_exact(deltas: list[TokenDelta], text: str) -> None:
    """The deltas are the job's output once, in order (the echo engine's tokens are its bytes)."""
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == list(text.encode())
    orders = [tuple(map(int, d.event_id.split("-"))) for d in deltas]
    assert orders == sorted(set(orders))


def calls(admin: redis.Redis, command: str) -> int:
    return admin.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def pubsub_connections(admin: redis.Redis) -> int:
    return len(admin.client_list(_type="pubsub"))


def followed(admin: redis.Redis | redis.RedisCluster, job_ids: list[str]) -> None:
    """Until every job's reader has followed it (FOLLOW): its worker publishes each event from the first."""
    eventually(lambda: all(admin.hget(KEYS.job(job_id), "streamed") == "1" for job_id in job_ids), timeout=WAIT_S)


def stream_in_threads(client: Client, job_ids: list[str], serve, admin, during=None) -> dict[str, list[TokenDelta]]:
    """Each job streamed by a thread of its own, over the one client, its worker (`serve()`) started
    once every reader follows its job; `during(deltas)` runs in the test's thread once every reader
    has its first delta."""
    read: dict[str, list[TokenDelta]] = {job_id: [] for job_id in job_ids}
    started = threading.Barrier(len(job_ids) + 1)
    errors: list[BaseException] = []

    def read_one(job_id: str) -> None:
        try:
            for n, delta in enumerate(client.stream(job_id, timeout=WAIT_S)):
                read[job_id].append(delta)
                if n == 0:
                    started.wait(WAIT_S)
        except BaseException as error:  # raised in the test's thread below
            errors.append(error)
            started.abort()

    threads = [threading.Thread(target=read_one, args=(job_id,)) for job_id in job_ids]
    for thread in threads:
        thread.start()
    followed(admin, job_ids)
    with serve():
        started.wait(WAIT_S)
        if during is not None:
            during(read)
        for thread in threads:
            thread.join(WAIT_S)
    assert not errors, errors
    return read


def test_concurrent_streams_of_one_client_share_one_subscriber_and_read_no_stream_per_event(
    redis_server, redis_client, queue
):
    """Four jobs streamed at once by one Client: one pub/sub connection while they run, the events
    taken from its messages, the event stream read a few times a reader (its subscription's
    confirmation), each reader's deltas its result exactly, and the channels left after."""
    with Client(redis_server.url, queue) as client:
        job_ids = [client.submit(prompt(i), max_tokens=TOKENS) for i in range(JOBS)]
        reads_before = calls(redis_client, "xread")
        seen: list[int] = []
        read = stream_in_threads(
            client,
            job_ids,
            lambda: serving(redis_server.url, queue, **PACE),
            redis_client,
            during=lambda _: seen.append(pubsub_connections(redis_client)),
        )
        reads = calls(redis_client, "xread") - reads_before
        results = {job_id: client.result(job_id, timeout=WAIT_S) for job_id in job_ids}
    for job_id in job_ids:
        assert_exact(read[job_id], results[job_id].text)
    assert seen == [1]
    # Each reader reads its stream a few times at most (after its subscription's confirmation),
    # however many events its job has: more than that.
    assert reads <= 3 * JOBS < calls(redis_client, "spublish")
    channels = [KEYS.events_channel(job_id) for job_id in job_ids]
    eventually(lambda: redis_client.execute_command("PUBSUB", "SHARDNUMSUB", *channels)[1::2] == [0] * JOBS)


def test_a_feed_its_reader_does_not_take_holds_a_bounded_number_of_messages():
    """Past HELD messages untaken, a Feed drops them and has its reader read the stream."""
    feed = ThreadFeed("job", "channel")
    for i in range(HELD + 5):
        feed.push(Published(f"0-{i}", f"0-{i + 1}", "tokens", "{}"))
    messages, stale = feed.take()
    assert (len(messages), stale) == (5, True)


def test_concurrent_streams_of_one_async_client_share_one_subscriber(redis_server, redis_client, queue):
    async def read_all(job_ids: list[str]) -> list[list[TokenDelta]]:
        async with AsyncClient(redis_server.url, queue) as client:

            async def one(job_id: str) -> list[TokenDelta]:
                return [delta async for delta in client.stream(job_id, timeout=WAIT_S)]

            return await asyncio.gather(*(one(job_id) for job_id in job_ids))

    with Client(redis_server.url, queue) as client:
        job_ids = [client.submit(prompt(i), max_tokens=TOKENS) for i in range(JOBS)]
        reads_before = calls(redis_client, "xread")
        read: list[list[TokenDelta]] = []
        readers = threading.Thread(target=lambda: read.extend(asyncio.run(read_all(job_ids))))
        readers.start()
        followed(redis_client, job_ids)
        with serving(redis_server.url, queue, **PACE):
            readers.join(WAIT_S)
        reads = calls(redis_client, "xread") - reads_before
        results = [client.result(job_id, timeout=WAIT_S) for job_id in job_ids]
    for deltas, result in zip(read, results, strict=True):
        assert_exact(deltas, result.text)
    assert reads <= 3 * JOBS < calls(redis_client, "spublish")


def test_a_subscriber_connection_killed_mid_stream_loses_and_repeats_nothing(redis_server, redis_client, queue):
    """CLIENT KILL of the subscriber while four jobs stream: redis-py connects again and
    subscribes again, dropping what was published meanwhile; each confirmation makes its reader
    read the stream from its last event, and the messages after it follow on."""

    def kill_subscriber(_read) -> None:
        assert redis_client.client_kill_filter(_type="pubsub") == 1
        eventually(lambda: pubsub_connections(redis_client) == 1, timeout=10)  # subscribed again

    slow = {**PACE, "step_s": 0.01}
    with Client(redis_server.url, queue) as client:
        job_ids = [client.submit(prompt(i), max_tokens=TOKENS) for i in range(JOBS)]
        serve = lambda: serving(redis_server.url, queue, **slow)  # noqa: E731
        read = stream_in_threads(client, job_ids, serve, redis_client, during=kill_subscriber)
        results = {job_id: client.result(job_id, timeout=WAIT_S) for job_id in job_ids}
        assert not client.subscriber.feeds.refused
    for job_id in job_ids:
        assert_exact(read[job_id], results[job_id].text)


@pytest.mark.parametrize("dropped", ["every fifth", "all"])
def test_messages_that_never_arrive_are_read_from_the_stream(redis_server, redis_client, queue, monkeypatch, dropped):
    """A message lost (every fifth: the next one's previous id is not the reader's last, and it
    reads the stream), or none at all (a worker that does not publish: the reader reads the stream
    after each silence of a read's block): the deltas are still the result exactly."""
    dispatch, count = Feeds.dispatch, iter(range(10**9))

    def dropping(self, message):
        if message["type"] == "smessage" and (dropped == "all" or next(count) % 5 == 4):
            return
        dispatch(self, message)

    monkeypatch.setattr(Feeds, "dispatch", dropping)
    with Client(redis_server.url, queue) as client:
        job_ids = [client.submit(prompt(i), max_tokens=TOKENS) for i in range(JOBS)]
        read = stream_in_threads(client, job_ids, lambda: serving(redis_server.url, queue, **PACE), redis_client)
        results = {job_id: client.result(job_id, timeout=WAIT_S) for job_id in job_ids}
    for job_id in job_ids:
        assert_exact(read[job_id], results[job_id].text)


def test_a_reader_refused_the_channel_reads_the_stream(queue):
    """A user with the producer's rights but no channel's (the producer user of docs/security.md
    before the event channels): Redis refuses its SSUBSCRIBE, and its readers read the stream with
    blocking XREADs; the worker's user has none either, its scripts' SPUBLISH refused in a pcall."""
    with acl_server() as server:
        admin = server["admin"]
        for command in acl_commands():
            refused = [word for word in command if not (word.startswith("&") or word in ("+ssubscribe", "+spublish"))]
            admin.execute_command(*refused)
        base = server["producer"].rsplit("@", 1)[1]
        producer, worker = (
            f"redis://mili-{role}:{PASSWORDS[f'{role.upper()}_PASSWORD']}@{base}" for role in ("producer", "worker")
        )
        with Client(producer, queue) as client:
            job_ids = [client.submit(prompt(i), max_tokens=TOKENS) for i in range(2)]
            read = stream_in_threads(client, job_ids, lambda: serving(worker, queue, **PACE), admin)
            results = {job_id: client.result(job_id, timeout=WAIT_S) for job_id in job_ids}
            assert client.subscriber.feeds.refused
        assert calls(admin, "spublish") == 0 < calls(admin, "xread")  # refused in the scripts' pcall
    for job_id in job_ids:
        assert_exact(read[job_id], results[job_id].text)


def test_the_documented_users_stream_over_the_subscriber(queue):
    """The producer and worker users of docs/security.md, as written: the worker's scripts
    publish, and the producer's reader takes the messages."""
    with acl_server() as server:
        admin = server["admin"]
        with Client(server["producer"], queue) as client:
            job_ids = [client.submit(prompt(i), max_tokens=TOKENS) for i in range(2)]
            read = stream_in_threads(client, job_ids, lambda: serving(server["worker"], queue, **PACE), admin)
            results = {job_id: client.result(job_id, timeout=WAIT_S) for job_id in job_ids}
            assert not client.subscriber.feeds.refused
        assert calls(admin, "spublish") > 0
        errors = admin.info("errorstats")
        assert "errorstat_NOPERM" not in errors, errors
    for job_id in job_ids:
        assert_exact(read[job_id], results[job_id].text)


def test_every_deployment_streams_exactly_and_a_cluster_reads_the_streams(
    redis_deployment, deployment_client, queue, monkeypatch
):
    """One server and a Sentinel's master: over the subscriber. A cluster: the readers read the
    streams with blocking XREADs (its pub/sub is a connection a node, not used yet)."""
    broken: list[bool] = []
    open_feed = Subscriber._open

    def noted(self, feed):
        open_feed(self, feed)
        broken.append(feed.broken)

    monkeypatch.setattr(Subscriber, "_open", noted)
    with Client(redis_deployment.url, queue) as client:
        job_ids = [client.submit(prompt(i), max_tokens=TOKENS) for i in range(2)]
        read = stream_in_threads(
            client, job_ids, lambda: serving(redis_deployment.url, queue, **PACE), deployment_client
        )
        results = {job_id: client.result(job_id, timeout=WAIT_S) for job_id in job_ids}
    for job_id in job_ids:
        assert_exact(read[job_id], results[job_id].text)
    assert broken == [is_cluster(client.redis)] * len(job_ids)


def test_a_reader_far_behind_reads_the_kept_events_batch_after_batch_without_waiting(redis_server, redis_client, queue):
    """A job whose stream kept several batches of events, read from its start by a stream() with a
    short timeout (the board's job page calls stream() again after each keep-alive's timeout): no
    message announces the events already there, so the reader read one batch a silence (2 s) and
    never reached the end within its timeout (seen as a board page's text cut short after a retry)."""
    tokens = 3 * EVENT_BATCH
    text = ("abcdefghij" * tokens)[:tokens]
    with Client(redis_server.url, queue) as client:
        job_id = client.submit(text, max_tokens=tokens)
        first = stream_in_threads(
            client,
            [job_id],
            lambda: serving(redis_server.url, queue, step_s=0.001, stream_interval_s=0.0001),
            redis_client,
        )[job_id]
        result = client.result(job_id, timeout=WAIT_S)
        assert len(first) > 2 * EVENT_BATCH  # more batches kept than one read takes
        again = list(client.stream(job_id, timeout=1.5))
    assert_exact(first, result.text)
    assert_exact(again, result.text)


def test_an_asyncio_run_ends_when_its_end_cancels_the_subscriber_as_it_sends_a_command(redis_server, queue):
    """asyncio.run() cancels every task left once its main coroutine has ended, and waits for them.
    Here its cancel of the AsyncClient's subscriber task comes as the task sends the SUNSUBSCRIBE
    of the channel its last reader left (the send held until the main coroutine ends, then made
    in the same turn of the loop): redis-py sends in an asyncio.wait_for, which up to Python 3.11
    returns as if no cancel had come when the command is sent by then, and the task read on for
    ever, asyncio.run() waiting for it: a forked child of tests/queue/test_fork.py whose main
    coroutine ended so, once in a loaded CI run, hung there until killed."""
    client = AsyncClient(redis_server.url, queue)
    sends: list[str] = []

    def held_until_ended(sending: asyncio.Event) -> None:
        """The subscriber's next SUNSUBSCRIBE held until the calling task, the main coroutine's, ends."""
        main = asyncio.current_task()
        assert main is not None
        connection = client.subscriber.pubsub.connection
        send = connection._send_packed_command  # the write that redis-py's wait_for runs as a task

        async def sent_once_main_ended(command) -> None:
            if b"SUNSUBSCRIBE" in b"".join(bytes(part) for part in command):
                sends.append("SUNSUBSCRIBE")
                sending.set()
                # Woken by main's end in the same turn of the loop as asyncio.run()'s own callback, which
                # stops the loop after that turn and cancels the tasks left: the subscriber's, sending.
                await main
            await send(command)

        connection._send_packed_command = sent_once_main_ended

    async def stream_to_its_end() -> str:
        job_id = await client.submit(prompt(0), max_tokens=TOKENS)
        deltas = client.stream(job_id, timeout=WAIT_S)
        read = [await anext(deltas)]
        sending = asyncio.Event()
        held_until_ended(sending)
        # To its end: its channel left, the subscriber's task sends the SUNSUBSCRIBE at its next turn.
        read += [delta async for delta in deltas]
        await asyncio.wait_for(sending.wait(), WAIT_S)
        return "".join(delta.text for delta in read)

    read: list[str] = []
    running = threading.Thread(target=lambda: read.append(asyncio.run(stream_to_its_end())))
    with serving(redis_server.url, queue, **PACE):
        running.start()
        running.join(10 * POLL_S)
        hung = running.is_alive()
        client.subscriber.closed = True  # a task reading on sees it within POLL_S: the thread ends either way
        running.join(WAIT_S)
    assert (sends, read, hung) == (["SUNSUBSCRIBE"], [prompt(0)], False)
