"""A client made before its process forks (gunicorn --preload, uWSGI, multiprocessing's and Celery's
prefork), used in the children and the parent at once, against a real redis-server and a real
echo worker process: every job's result and stream in each process is that job's own output,
exactly, and nobody's replies go to another process. A child has neither the parent's connections
(its pool and its subscriber connect afresh) nor the parent's threads (its subscriber starts its
own), whatever those threads held at the fork."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading
import traceback
from collections.abc import Callable

import pytest

from producer_client import AsyncClient, Client
from tests.support.workers import echo_workers

pytestmark = pytest.mark.waits

CHILDREN = 3
JOBS = 3  # each process's jobs of each kind
WAIT_S = 60  # a child that is not done by then is killed: a hang fails the test, it does not stall it
TOKENS = 400


def prompt(owner: str, i: int) -> str:
    """A prompt naming its process and job, so that a reply stolen from another process shows."""
    return (f"{owner}/{i}:" + "abcdefghij" * TOKENS)[:TOKENS]


def use_client(client: Client, owner: str) -> None:
    """submit() then stream(), submit() then result(), and generate(), JOBS of each: each reply the
    job's own output exactly (the echo engine's output is its prompt)."""
    streamed = [client.submit(prompt(owner, i), max_tokens=TOKENS, stream=True) for i in range(JOBS)]
    waited = [client.submit(prompt(owner, JOBS + i), max_tokens=TOKENS) for i in range(JOBS)]
    for i, job_id in enumerate(streamed):
        text = "".join(delta.text for delta in client.stream(job_id, timeout=WAIT_S))
        assert text == prompt(owner, i), (owner, job_id)
    for i, job_id in enumerate(waited):
        assert client.result(job_id, timeout=WAIT_S).text == prompt(owner, JOBS + i), (owner, job_id)
    for i in range(JOBS):
        text = prompt(owner, 2 * JOBS + i)
        assert client.generate(text, max_tokens=TOKENS, timeout=WAIT_S).text == text, owner


class Hung(Exception):
    """A child's work did not end in WAIT_S: its traceback says where it waited."""


def hung(signum: int, frame: object) -> None:
    raise Hung(f"not done in {WAIT_S} s")


def forked(work: Callable[[], None]) -> tuple[int, int]:
    """`work` in a child of os.fork(): (pid, read end of a pipe that gets its traceback if it fails)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        os.close(read_end)
        code = 0
        try:
            signal.signal(signal.SIGALRM, hung)
            signal.alarm(WAIT_S)
            work()
        except BaseException:
            os.write(write_end, traceback.format_exc().encode())
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    return pid, read_end


def joined(children: list[tuple[int, int]]) -> list[str]:
    """Each child's failure: its traceback, or how it ended; [] if every child did its work."""
    failures = []
    for pid, read_end in children:
        with os.fdopen(read_end, "rb") as pipe:
            output = pipe.read().decode()
        _, status = os.waitpid(pid, 0)
        if status != 0:
            failures.append(output or f"child {pid}: wait status {status} ")
    return failures


def assert_done(children: list[tuple[int, int]]) -> None:
    failures = joined(children)
    assert not failures, "\n".join(failures)


def in_thread(work: Callable[[], None]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as error:  # raised in the test's thread
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


def subscriber_address(client: Client) -> object:
    """The local address of the client's subscriber connection: one per process."""
    return client.subscriber.pubsub.connection._sock.getsockname()


@pytest.fixture
def worker(redis_server, queue, tmp_path):
    with echo_workers(redis_server.url, queue, tmp_path, count=1) as workers:
        yield workers[0]


def test_forked_children_submit_stream_and_generate_while_the_parent_does(redis_server, queue, worker):
    """A Client that submitted and streamed before os.fork(), used by three children and the
    parent at once: each gets its own jobs' outputs exactly, each child over a subscriber
    connection of its own."""
    with Client(redis_server.url, queue) as client:
        use_client(client, "parent-before")
        parents = subscriber_address(client)

        def child() -> None:
            use_client(client, f"child-{os.getpid()}")
            assert subscriber_address(client) != parents

        children = [forked(child) for _ in range(CHILDREN)]
        use_client(client, "parent-during")
        assert_done(children)
        use_client(client, "parent-after")
        assert subscriber_address(client) == parents


def test_multiprocessing_fork_children_use_the_parents_client(redis_server, queue, worker):
    """The same, with multiprocessing's fork start method (Celery's prefork, a Pool's workers)."""
    context = multiprocessing.get_context("fork")
    with Client(redis_server.url, queue) as client:
        use_client(client, "parent-before")
        failures = context.Queue()

        def child(n: int) -> None:
            try:
                use_client(client, f"child-{n}")
            except BaseException:
                failures.put(traceback.format_exc())
                raise

        processes = [context.Process(target=child, args=(n,)) for n in range(CHILDREN)]
        for process in processes:
            process.start()
        use_client(client, "parent-during")
        for process in processes:
            process.join(WAIT_S)
        stuck = [process.pid for process in processes if process.is_alive()]
        for process in processes:
            process.kill() if process.is_alive() else None
        assert stuck == []
        assert [failures.get() for process in processes if process.exitcode != 0] == []


def test_a_fork_while_the_subscriber_is_reading_and_holding_its_locks_leaves_the_child_a_working_one(
    redis_server, queue, worker
):
    """Forked while a parent thread streams (the subscriber's thread in the middle of a read) and
    while another holds the subscriber's and its readers' locks, as a fork at an unlucky moment
    finds them: the child's stream() neither waits for a lock nobody in it will release nor for a
    thread it does not have, and the parent's stream goes on."""
    with Client(redis_server.url, queue) as client:
        long_prompt = prompt("parent-long", 0) * 10
        long_job = client.submit(long_prompt, max_tokens=len(long_prompt), stream=True)
        first = threading.Event()
        read: list[str] = []

        def stream_long() -> None:
            for delta in client.stream(long_job, timeout=WAIT_S):
                read.append(delta.text)
                first.set()

        reader, reader_errors = in_thread(stream_long)
        assert first.wait(WAIT_S)
        held, release = threading.Event(), threading.Event()

        def hold_locks() -> None:
            with client.subscriber.lock, client.subscriber.feeds.lock:
                held.set()
                release.wait(WAIT_S)

        holder, _ = in_thread(hold_locks)
        assert held.wait(WAIT_S)
        children = [forked(lambda: use_client(client, f"child-{os.getpid()}")) for _ in range(2)]
        release.set()
        holder.join(WAIT_S)
        assert_done(children)
        reader.join(WAIT_S)
        assert reader_errors == []
        assert "".join(read) == long_prompt
        use_client(client, "parent-after")


def test_a_stream_the_fork_came_in_goes_on_to_its_end_in_the_child_and_in_the_parent(redis_server, queue, worker):
    """A fork in the middle of a stream() (its reader between two deltas): the child carries the
    reader on, reading the job's stream itself (its channel is subscribed to in the parent alone),
    and both processes read the job's whole output exactly once."""
    with Client(redis_server.url, queue) as client:
        long_prompt = prompt("parent-long", 0) * 10
        job_id = client.submit(long_prompt, max_tokens=len(long_prompt), stream=True)
        deltas = client.stream(job_id, timeout=WAIT_S)
        read = [next(deltas).text]

        def child() -> None:
            assert "".join(read + [delta.text for delta in deltas]) == long_prompt
            use_client(client, f"child-{os.getpid()}")

        children = [forked(child) for _ in range(2)]
        assert "".join(read + [delta.text for delta in deltas]) == long_prompt
        assert_done(children)


def test_many_threads_submit_and_stream_over_one_client_at_once(redis_server, queue, worker):
    """One Client shared by 12 threads, each submitting, streaming, waiting on and generating
    several jobs at once: each thread's replies are its own jobs', exactly."""
    with Client(redis_server.url, queue) as client:
        threads = [in_thread(lambda n=n: use_client(client, f"thread-{n}")) for n in range(12)]
        for thread, _ in threads:
            thread.join(3 * WAIT_S)
        assert [thread.is_alive() for thread, _ in threads] == [False] * 12
        assert [error for _, errors in threads for error in errors] == []


async def use_async_client(client: AsyncClient, owner: str) -> None:
    """use_client(), for an AsyncClient: its jobs at once."""

    async def streamed(i: int) -> None:
        job_id = await client.submit(prompt(owner, i), max_tokens=TOKENS, stream=True)
        text = "".join([delta.text async for delta in client.stream(job_id, timeout=WAIT_S)])
        assert text == prompt(owner, i), (owner, job_id)

    async def waited(i: int) -> None:
        job_id = await client.submit(prompt(owner, JOBS + i), max_tokens=TOKENS)
        assert (await client.result(job_id, timeout=WAIT_S)).text == prompt(owner, JOBS + i), (owner, job_id)

    async def generated(i: int) -> None:
        text = prompt(owner, 2 * JOBS + i)
        assert (await client.generate(text, max_tokens=TOKENS, timeout=WAIT_S)).text == text, owner

    await asyncio.gather(*(kind(i) for kind in (streamed, waited, generated) for i in range(JOBS)))


def test_an_async_client_forked_while_its_loop_runs_works_in_a_new_loop_of_each_child(redis_server, queue, worker):
    """An AsyncClient whose loop runs on in the parent (a thread's), used there before and during
    the fork: each child's asyncio.run() of it gets its own jobs' outputs over connections of its
    own, and the parent's loop goes on using it meanwhile."""
    loop = asyncio.new_event_loop()
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    looping.start()

    def in_loop(coroutine) -> object:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(3 * WAIT_S)

    client = AsyncClient(redis_server.url, queue)
    try:
        in_loop(use_async_client(client, "parent-before"))
        children = [forked(lambda: asyncio.run(use_async_client(client, f"child-{os.getpid()}"))) for _ in range(2)]
        in_loop(use_async_client(client, "parent-during"))
        assert_done(children)
        in_loop(use_async_client(client, "parent-after"))
    finally:
        in_loop(client.aclose())
        loop.call_soon_threadsafe(loop.stop)
        looping.join(WAIT_S)
        loop.close()


ROUNDS = 60  # each process's submits: enough that shared sockets would cross their replies


def submitted_as_asked(client: Client, owner: str) -> None:
    """Submits, each followed by its status: every reply is the one this process asked for."""
    for i in range(ROUNDS):
        job_id = client.submit(f"{owner} {i}", request_id=f"{owner}-{i}", max_tokens=4)
        assert (job_id, client.status(job_id).id) == (f"{owner}-{i}", f"{owner}-{i}")


async def async_submitted_as_asked(client: AsyncClient, owner: str) -> None:
    for i in range(ROUNDS):
        job_id = await client.submit(f"{owner} {i}", request_id=f"{owner}-{i}", max_tokens=4)
        assert (job_id, (await client.status(job_id)).id) == (f"{owner}-{i}", f"{owner}-{i}")


def test_a_forked_client_of_each_deployment_talks_over_connections_of_its_own(redis_deployment, queue):
    """One server, Sentinel's master, a cluster: a Client forked after use, the parent and its
    children submitting at once, each gets the replies it asked for."""
    with Client(redis_deployment.url, queue, placement=False) as client:
        submitted_as_asked(client, "parent-before")
        children = [forked(lambda: submitted_as_asked(client, f"child-{os.getpid()}")) for _ in range(2)]
        submitted_as_asked(client, "parent-during")
        assert_done(children)


def test_a_forked_async_client_of_each_deployment_talks_over_connections_of_its_own(redis_deployment, queue):
    """The same of an AsyncClient whose loop runs on in the parent: each child's asyncio.run()."""
    loop = asyncio.new_event_loop()
    looping = threading.Thread(target=loop.run_forever, daemon=True)
    looping.start()

    def in_loop(coroutine) -> object:
        return asyncio.run_coroutine_threadsafe(coroutine, loop).result(3 * WAIT_S)

    client = AsyncClient(redis_deployment.url, queue, placement=False)
    try:
        in_loop(async_submitted_as_asked(client, "parent-before"))
        children = [
            forked(lambda: asyncio.run(async_submitted_as_asked(client, f"child-{os.getpid()}"))) for _ in range(2)
        ]
        in_loop(async_submitted_as_asked(client, "parent-during"))
        assert_done(children)
    finally:
        in_loop(client.aclose())
        loop.call_soon_threadsafe(loop.stop)
        looping.join(WAIT_S)
        loop.close()


def test_an_async_client_whose_loop_ended_before_the_fork_works_in_a_new_loop_of_each_child(redis_server, queue):
    """An AsyncClient used in an asyncio.run() that ended before the fork: each child's own
    asyncio.run() of it talks over connections of its own."""
    client = AsyncClient(redis_server.url, queue, placement=False)
    asyncio.run(async_submitted_as_asked(client, "parent-before"))
    children = [forked(lambda: asyncio.run(async_submitted_as_asked(client, f"child-{os.getpid()}"))) for _ in range(2)]
    assert_done(children)


def test_a_cluster_client_forked_while_a_thread_refreshes_the_topology_works_in_the_child(redis_cluster, queue):
    """A Client of a cluster forked while a thread of the parent's holds the cluster client's
    locks, as a topology refresh does (redis-py's nodes manager holds its initialization lock for
    the whole refresh, its lock to swap the tables in): the child's submits and its own refresh
    (a MOVED would start one) do not wait for a thread it does not have, and the parent's go on."""
    with Client(redis_cluster.url, queue, placement=False) as client:
        submitted_as_asked(client, "parent-before")
        cluster, manager = client.redis, client.redis.nodes_manager
        held, release = threading.Event(), threading.Event()

        def refreshing() -> None:
            with manager._initialization_lock, manager._lock, cluster._lock, manager.read_load_balancer._lock:
                held.set()
                release.wait(WAIT_S)

        def in_child() -> None:
            submitted_as_asked(client, f"child-{os.getpid()}")
            manager.initialize()
            submitted_as_asked(client, f"child-{os.getpid()}-refreshed")

        holder, holder_errors = in_thread(refreshing)
        assert held.wait(WAIT_S)
        children = [forked(in_child) for _ in range(2)]
        release.set()
        holder.join(WAIT_S)
        assert_done(children)
        assert holder_errors == []
        submitted_as_asked(client, "parent-after")
