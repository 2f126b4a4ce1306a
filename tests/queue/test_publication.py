"""Coalesced publication (worker/loop/pace.py, worker/loop/publication.py), with the queue loop in this
process on a real redis-server: streamed deltas add up to the result whatever the intervals, a
killed worker loses at most one publish interval of tokens, a slow reader never holds the worker
up, and a streamed token reaches its reader within stream_interval_s however many streams run."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from harness.echo_workers import GatedWorker, SlowEchoEngine, serving
from harness.polling import eventually
from producer_client import Client
from producer_client.keys import Keys
from tests.support.cpu_waits import CpuWaits
from tests.support.jobs import assert_one_final_result, runs, tokens_published

pytestmark = pytest.mark.waits

KEYS = Keys()
FAST_RECLAIM = dict(claim_idle_ms=500, reclaim_interval_s=0.05)


def prompt(i: int, n: int) -> str:
    """`n` bytes of UTF-8 with two- and three-byte characters, which the echo engine's decoder
    holds back until whole: some steps add tokens and no text, the end may flush text alone."""
    text = f"{i}:" + "".join("aé€z"[(i + k) % 4] for k in range(n))
    return text.encode()[:n].decode(errors="ignore")


class RecordingEchoEngine(SlowEchoEngine):
    """Notes when each job's tokens were sampled (the wall clock: Redis's event ids and readers in
    other processes share it on one machine)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sampled: dict[str, list[float]] = {}

    def step(self):
        outputs = super().step()
        now = time.time()
        for out in outputs:
            self.sampled.setdefault(out.request_id.job_id, []).extend([now] * len(out.new_token_ids))
        return outputs


@pytest.mark.parametrize("stream_s, checkpoint_s", [(0.001, 0.001), (0.02, 0.05), (0.2, 1.0), (2.0, 10.0)])
def test_streamed_deltas_concatenate_to_the_result_at_any_interval_setting(
    redis_server, redis_client, queue, stream_s, checkpoint_s
):
    intervals = {"stream_interval_s": stream_s, "checkpoint_interval_s": checkpoint_s}
    with Client(redis_server.url, queue) as client, serving(redis_server.url, queue, step_s=0.002, **intervals):
        prompts = {client.submit(prompt(i, 150), max_tokens=150, stream=i % 3 == 0): prompt(i, 150) for i in range(6)}
        ids = list(prompts)
        read = {job_id: list(client.stream(job_id, timeout=20)) for job_id in ids[:4]}  # streamed, and followed
        head = read[ids[0]][: len(read[ids[0]]) // 2]
        tail = list(client.stream(ids[0], after=head[-1].event_id, timeout=20)) if head else read[ids[0]]
        results = {job_id: client.result(job_id, timeout=20) for job_id in ids}
    for job_id, text in prompts.items():
        result = results[job_id]
        assert (result.status, result.text, result.token_ids) == ("done", text, list(text.encode()))
        assert tokens_published(redis_client, job_id) == result.token_ids
        assert_one_final_result(redis_client, job_id)
        if job_id in read:
            deltas = read[job_id]
            assert "".join(d.text for d in deltas) == result.text
            assert [t for d in deltas for t in d.token_ids] == result.token_ids
            assert len({d.event_id for d in deltas}) == len(deltas)
    assert head + tail == read[ids[0]]


def test_a_job_a_reader_follows_mid_run_is_published_at_the_stream_pace_from_its_next_checkpoint(redis_server, queue):
    """A job submitted unstreamed publishes every checkpoint_interval_s; once a reader follows it,
    its worker sees the flag within that interval (a look at the hash, or a PUBLISH answering
    `followed`), and its tokens go out at the stream's pace from then on: over 1.5 s of 10 ms steps,
    at most 5 deltas unnoticed (one a checkpoint), about one a step noticed."""
    intervals = {"stream_interval_s": 0.02, "checkpoint_interval_s": 0.4}
    with Client(redis_server.url, queue) as client, serving(redis_server.url, queue, step_s=0.01, **intervals):
        job_id = client.submit(prompt(0, 150), max_tokens=150)
        assert eventually(lambda: client.status(job_id).tokens > 0, timeout=10)  # its first tokens, unstreamed
        deltas = list(client.stream(job_id, timeout=20))
        result = client.result(job_id, timeout=20)
    assert "".join(d.text for d in deltas) == result.text
    assert len(deltas) > 10


def test_a_job_started_between_the_checkpoints_of_jobs_read_whole_publishes_its_first_tokens_at_once(
    redis_server, queue
):
    """A worker whose jobs are all read whole asks them nothing between their due times (pace.py);
    a job that starts meanwhile is heard of (its start, its run's first output), and its first
    tokens go out with the next round, not at the running job's checkpoint 10 s later: the second
    job's hash counts tokens while it still runs (its 400 steps of 10 ms, 4 s at least)."""
    intervals = {"stream_interval_s": 0.02, "checkpoint_interval_s": 10.0}
    with Client(redis_server.url, queue) as client, serving(redis_server.url, queue, step_s=0.01, **intervals):
        first = client.submit(prompt(0, 800), max_tokens=800)
        assert eventually(lambda: client.status(first).tokens > 0, timeout=10)  # its first tokens, then quiet
        second = client.submit(prompt(1, 400), max_tokens=400)
        status = eventually(lambda: (s := client.status(second)).tokens > 0 and s, timeout=20)
        assert status and status.status == "running", status
        assert client.status(first).tokens < 100  # the first job's checkpoint has not come (its 800 tokens, 8 s)


@pytest.mark.timing
@pytest.mark.parametrize("streamed", [True, False])
def test_a_killed_worker_loses_at_most_one_publish_interval_of_tokens(redis_server, redis_client, queue, streamed):
    """The victim stops dead between two exchanges (as after kill -9: nothing handed over), while
    four jobs have run for several intervals. Each loses no more than the tokens of one interval,
    give or take the round out and a step; a survivor resumes each after its recorded tokens, and
    the output is the one a fault-free run gives."""
    step_s, intervals = 0.01, {"stream_interval_s": 0.05, "checkpoint_interval_s": 0.2}
    interval = intervals["stream_interval_s" if streamed else "checkpoint_interval_s"]
    prompts = [prompt(i, 250) for i in range(4)]
    with Client(redis_server.url, queue) as client:
        with serving(
            redis_server.url,
            queue,
            step_s=step_s,
            worker_class=GatedWorker,
            name=f"victim-{queue}",
            **intervals,
            **FAST_RECLAIM,
        ) as victim:
            ids = [client.submit(p, max_tokens=250, stream=streamed) for p in prompts]
            assert eventually(
                lambda: all(len(getattr(victim.holdings.running.get(j), "token_ids", ())) >= 1 for j in ids)
            )
            time.sleep(4 * interval)  # several intervals of output, recorded as it goes
            victim.killed = True
            victim.gate.clear()
            made = settled_output(victim, ids)
            recorded = [int(redis_client.hget(KEYS.job(j), "tokens")) for j in ids]
            with serving(redis_server.url, queue, step_s=0.002, name=f"survivor-{queue}", **intervals, **FAST_RECLAIM):
                results = [client.result(j, timeout=20) for j in ids]
            victim.gate.set()  # its thread ends at the gate
    for job_id, text, result, n_made, n_recorded in zip(ids, prompts, results, made, recorded):
        assert (result.status, result.text) == ("done", text)
        assert tokens_published(redis_client, job_id) == result.token_ids  # none twice
        (first, _), (second, _) = runs(redis_client, job_id)
        assert (first["worker"], second["worker"], second["resumed_tokens"]) == (
            f"victim-{queue}",
            f"survivor-{queue}",
            n_recorded,
        )
        lost = n_made - n_recorded
        assert 0 <= lost <= round(interval / step_s) + 3, (n_made, n_recorded)


def settled_output(worker: GatedWorker, job_ids: list[str]) -> list[int]:
    """Each job's output once the killed worker's loop has stopped at its gate and its publisher
    has nothing out: what it made, recorded or not."""

    def lengths() -> list[int]:
        return [len(worker.holdings.running[j].token_ids) if j in worker.holdings.running else -1 for j in job_ids]

    last, still_since = lengths(), time.monotonic()
    while time.monotonic() - still_since < 0.2 or worker.publication.publisher.sending is not None:
        time.sleep(0.02)
        now = lengths()
        if now != last:
            last, still_since = now, time.monotonic()
    assert min(last) > 0, "a job ended before the kill"
    return last


def test_a_slow_reader_never_stalls_the_worker(redis_server, queue):
    """One reader stops after its first delta until every job has ended, another stops reading
    for good after its first: the jobs end all the same (a worker that waited for its readers
    would never end them), and the slow reader gets every token once it reads on."""
    step_s, n = 0.005, 100
    with Client(redis_server.url, queue) as client, serving(redis_server.url, queue, step_s=step_s):
        ids = [client.submit(prompt(i, n), max_tokens=n, stream=True) for i in range(4)]
        stopped = client.stream(ids[1], timeout=20)
        next(stopped)
        slow = client.stream(ids[0], timeout=20)
        deltas = [next(slow)]
        results = [client.result(j, timeout=20) for j in ids]
        deltas += list(slow)
        stopped.close()
    assert "".join(d.text for d in deltas) == results[0].text == prompt(0, n)
    assert [r.status for r in results] == ["done"] * 4
    assert len(deltas) > 1  # it read on after the jobs had ended


def p99(values: list[float]) -> float:
    return sorted(values)[int(len(values) * 0.99)]


def read_streams(url: str, queue: str, job_ids: list[str], out) -> None:
    """In a process of its own, as readers are: each token's (job, event time, arrival time). Says
    "reading" once every stream is open, before the worker starts."""
    import asyncio

    from producer_client import AsyncClient

    async def read_all() -> list:
        client = AsyncClient(url, queue, max_connections=len(job_ids) + 4)
        await asyncio.gather(*(client.redis.ping() for _ in job_ids))  # a connection per reader, made now
        arrivals, opened = [], []

        async def read(job_id: str) -> None:
            stream = client.stream(job_id, timeout=60)
            opened.append(job_id)
            if len(opened) == len(job_ids):
                out.put("reading")
            async for delta in stream:
                now, written = time.time(), int(delta.event_id.split("-")[0]) / 1000
                arrivals.extend([(job_id, written, now)] * len(delta.token_ids))

        try:
            await asyncio.gather(*(read(j) for j in job_ids))
        finally:
            await client.aclose()
        return arrivals

    out.put(asyncio.run(read_all()))


@pytest.mark.timing
def test_streamed_chunk_delay_stays_within_the_interval_under_load(redis_server, queue):
    """A worker full of streams (16 of its 16 slots), read by a process of their own: each job's
    tokens wait as long as the interval allows, every token is in Redis within stream_interval_s
    of its sampling (plus what the host kept the worker or Redis waiting for a CPU meanwhile: the
    promise holds while the host keeps up), and the reader wakes as it is written."""
    stream_s, step_s, n = 0.05, 0.01, 150
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    prompts = {f"{queue}-{i}": prompt(i, n) for i in range(16)}
    with Client(redis_server.url, queue) as client:
        for job_id, text in prompts.items():  # queued: no worker yet
            client.submit(text, max_tokens=n, stream=True, request_id=job_id)
        reader = ctx.Process(target=read_streams, args=(redis_server.url, queue, list(prompts), out))
        reader.start()
        assert out.get(timeout=120) == "reading"
        time.sleep(0.2)  # its first reads are blocked on the streams
        with (
            CpuWaits(os.getpid(), redis_server.process.pid) as cpu_waits,
            serving(
                redis_server.url,
                queue,
                step_s=step_s,
                engine_class=RecordingEchoEngine,
                stream_interval_s=stream_s,
                engine={"max_running": len(prompts)},
            ) as worker,
        ):
            arrivals = out.get(timeout=120)
            reader.join(30)
            sampled = worker.engine.sampled
    by_job: dict[str, list] = {}
    for job_id, written, arrived in arrivals:
        by_job.setdefault(job_id, []).append((written, arrived))
    to_redis, to_reader, delivered, waits, late = [], [], [], [], []
    for job_id, times in by_job.items():
        assert len(times) == len(prompts[job_id].encode())
        for (written, arrived), at in zip(times, sampled[job_id]):
            to_redis.append(written - at)
            to_reader.append(arrived - at)
            delivered.append(arrived - written)
            # The worker's part, sampling to the event's write, for every token: its lag counts a
            # round for the reader's read besides. Event ids are whole milliseconds: a token written
            # within the interval may read up to 1 ms late. The promise holds while the host keeps
            # up: the time the worker's threads and Redis waited for a CPU meanwhile comes on top.
            waits.append(waited := cpu_waits.during(at, written))
            if written - at > stream_s + 0.001 + waited:
                late.append((job_id, round((written - at) * 1e3, 1), round(waited * 1e3, 1)))
    print(
        f"delay to Redis: p99 {p99(to_redis) * 1e3:.1f} ms, max {max(to_redis) * 1e3:.1f} ms; to the reader: "
        f"p99 {p99(to_reader) * 1e3:.1f} ms, max {max(to_reader) * 1e3:.1f} ms; waited for a CPU meanwhile: "
        f"p99 {p99(waits) * 1e3:.1f} ms, max {max(waits) * 1e3:.1f} ms"
    )
    assert late == []  # (job, ms to Redis, ms waited for a CPU meanwhile) of each token over the bound
    # The reader's part: it blocks on the stream and wakes at the write (no polling), so most
    # tokens reach it within milliseconds of Redis; when its own process is not scheduled (a
    # loaded machine) they wait with it, which no worker can help.
    assert sorted(delivered)[len(delivered) // 2] <= 0.01
