"""The queue loop in this process, driving the echo engine, against a real redis-server:
what the protocol promises, independent of the model."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import redis

from harness.echo_workers import GatedWorker, HoldingEchoEngine, outcome_count, serving
from harness.polling import eventually
from producer_client import Client, JobExpired, JobFailed
from producer_client.keys import GROUP, PROTOCOL_VERSION, Keys
from worker.loop import done_sweep
from worker.loop.flex_pace import FLEX_YIELD_BATCH
from worker.loop.reads import FLEX_READ_BATCH

pytestmark = pytest.mark.waits

KEYS = Keys()


def test_a_job_round_trips_with_usage_and_ordered_timings(redis_server, client, queue):
    with serving(redis_server.url, queue) as worker:
        job_id = client.submit("hello world", max_tokens=5)
        result = client.result(job_id, timeout=10)
        assert (result.status, result.text, result.finish_reason, result.worker) == (
            "done",
            "hello",
            "length",
            worker.name,
        )
        assert result.token_ids == list(b"hello")
        assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (11, 5)
        t = result.timings
        assert t.queued_at <= t.started_at + 0.01 and t.started_at <= t.first_token_at <= t.finished_at
        assert client.result(job_id, timeout=1) == result  # a finished job answers from its hash at once
        status = client.status(job_id)
        assert (status.status, status.tokens, status.worker) == ("done", 5, worker.name)
        assert eventually(lambda: outcome_count(worker, "done") == 1)


def test_chat_messages_go_through_the_chat_template(redis_server, client, queue):
    with serving(redis_server.url, queue):
        result = client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=100, timeout=10)
    assert result.text == "user: hi\nassistant: "
    assert result.finish_reason == "stop"


def test_streamed_deltas_concatenate_and_a_resumed_stream_repeats_nothing(redis_server, client, queue):
    prompt = "héllo wörld — streamed ✓"
    with serving(redis_server.url, queue, step_s=0.002):
        job_id = client.submit(prompt, max_tokens=200)
        whole = list(client.stream(job_id, timeout=10))
        head = []
        for delta in client.stream(job_id, timeout=10):
            head.append(delta)
            if len(head) == 7:
                break  # a disconnect mid-stream
        tail = list(client.stream(job_id, after=head[-1].event_id, timeout=10))
        result = client.result(job_id, timeout=10)
    assert head + tail == whole
    assert "".join(d.text for d in whole) == result.text == prompt
    assert [t for d in whole for t in d.token_ids] == result.token_ids == list(prompt.encode())


def test_cancel_stops_running_jobs_within_their_publish_interval_and_frees_their_pages(redis_server, client, queue):
    """A running job hears from its hash as often as its tokens go out: every stream_interval_s
    when streamed, every checkpoint_interval_s otherwise. Four jobs at once, two of each, are
    cancelled one after the other over several times those intervals; each stops within its
    interval's worth of steps after its cancel is recorded, give or take the round out and a step.
    The loop is held while the cancel goes in, so that the tokens counted are those made after
    Redis recorded it: counted from before the call, a loaded machine's delay in sending it (its
    steps meanwhile) was charged to the worker."""
    step_s, intervals = 0.01, {"stream_interval_s": 0.05, "checkpoint_interval_s": 0.2}
    with serving(redis_server.url, queue, step_s=step_s, worker_class=GatedWorker, **intervals) as worker:
        free_before = worker.engine.capacity().free_pages
        jobs = {client.submit(c * 500, max_tokens=500, stream=c == "s"): c for c in "spsp"}
        assert eventually(lambda: all(len(getattr(worker.holdings.running.get(j), "token_ids", ())) >= 3 for j in jobs))
        made_before = {}
        for job_id in jobs:
            with worker.held():
                made_before[job_id] = len(worker.holdings.running[job_id].token_ids)
                assert client.cancel(job_id).cancel_requested
            time.sleep(0.15)
        for job_id, c in jobs.items():
            result = client.result(job_id, timeout=10)
            assert (result.status, result.finish_reason) == ("cancelled", "abort")
            assert result.text == c * result.usage.completion_tokens
            interval = intervals["stream_interval_s" if c == "s" else "checkpoint_interval_s"]
            made_after = result.usage.completion_tokens - made_before[job_id]
            assert 0 <= made_after <= round(interval / step_s) + 4, (c, made_after)
        assert worker.engine.capacity().free_pages == free_before
        assert eventually(lambda: outcome_count(worker, "cancelled") == 4)


def test_pending_entries_never_exceed_max_running(redis_server, client, queue, redis_client):
    with serving(
        redis_server.url, queue, step_s=0.002, engine={"max_running": 2, "max_num_batched_tokens": 64}
    ) as worker:
        seen = []
        read = worker.queue.reads.read

        def read_and_count(*args):
            entries = read(*args)
            seen.append(redis_client.xpending(KEYS.queue(queue), GROUP)["pending"])
            return entries

        worker.queue.reads.read = read_and_count
        ids = [client.submit("abcdefghij", max_tokens=10) for _ in range(12)]
        results = [client.result(i, timeout=20) for i in ids]
    assert all(r.status == "done" and r.text == "abcdefghij" for r in results)
    assert max(seen) == 2
    assert redis_client.xlen(KEYS.queue(queue)) == 0  # acked entries are deleted


def test_bad_entries_fail_with_their_code_and_the_worker_keeps_serving(redis_server, client, queue, redis_client):
    raw = redis.Redis.from_url(redis_server.url)  # bytes in, so that invalid UTF-8 can be written
    stream = KEYS.queue(queue)
    bad = {
        "not-json": ({"v": str(PROTOCOL_VERSION), "body": "{oops"}, "invalid_body"),
        "wrong-type": ({"v": str(PROTOCOL_VERSION), "body": '{"prompt": ["a"]}'}, "invalid_argument"),
        "unknown-field": ({"v": str(PROTOCOL_VERSION), "body": '{"prompt": "a", "model": "x"}'}, "invalid_argument"),
        "future": ({"v": "3", "body": '{"prompt": "a"}'}, "unsupported_version"),
        "bad-utf8": ({"v": str(PROTOCOL_VERSION), "body": b'{"prompt": "\xff\xfe"}'}, "invalid_body"),
        "too-long": (
            {"v": str(PROTOCOL_VERSION), "body": f'{{"input_ids": [{",".join(["7"] * 5000)}]}}'},
            "prompt_too_long",
        ),
        "out-of-vocab": ({"v": str(PROTOCOL_VERSION), "body": '{"input_ids": [1, 300]}'}, "invalid_argument"),
        "over-limit": (
            {"v": str(PROTOCOL_VERSION), "body": '{"prompt": "a", "params": {"max_tokens": 40000}}'},
            "invalid_argument",
        ),
    }
    bad = {f"{queue}-{name}": ({"id": f"{queue}-{name}", **fields}, code) for name, (fields, code) in bad.items()}
    with serving(redis_server.url, queue) as worker:
        good_before = client.submit("good", max_tokens=4)
        for fields, _ in bad.values():
            raw.xadd(stream, fields)
        no_id = raw.xadd(stream, {"v": str(PROTOCOL_VERSION), "body": '{"prompt": "a"}'}).decode()
        good_after = client.submit("fine", max_tokens=4)
        assert client.result(good_before, timeout=10).text == "good"
        assert client.result(good_after, timeout=10).text == "fine"
        for job_id, (_, code) in bad.items():
            with pytest.raises(JobFailed) as e:
                client.result(job_id, timeout=10)
            assert e.value.code == code, job_id
            assert e.value.result.status == "failed"
        with pytest.raises(JobFailed) as e:
            client.result(f"entry-{no_id}", timeout=10)
        assert e.value.code == "invalid_body"
        assert eventually(lambda: outcome_count(worker, "failed") == len(bad) + 1)
        assert eventually(lambda: outcome_count(worker, "done") == 2)
    assert redis_client.xlen(stream) == 0
    raw.close()


def test_a_job_past_its_deadline_is_not_started(redis_server, client, queue):
    job_id = client.submit("late", max_tokens=4, timeout_s=0.05)
    time.sleep(0.1)
    with serving(redis_server.url, queue) as worker:
        with pytest.raises(JobExpired):
            client.result(job_id, timeout=10)
        assert eventually(lambda: outcome_count(worker, "expired") == 1)
        with pytest.raises(JobExpired) as e:  # the expired result the worker wrote, carried by the error
            client.result(job_id, timeout=10)
    assert (e.value.result.status, e.value.result.text, e.value.result.token_ids) == ("expired", "", [])


def test_a_running_job_past_its_deadline_returns_its_partial_output(redis_server, client, queue):
    with serving(redis_server.url, queue, step_s=0.01):
        job_id = client.submit("y" * 400, max_tokens=400, timeout_s=0.5)
        result = client.result(job_id, timeout=10)
    assert (result.status, result.finish_reason) == ("done", "timeout")
    assert 0 < result.usage.completion_tokens < 400
    assert result.text == "y" * result.usage.completion_tokens


def test_a_failed_engine_step_fails_its_jobs_and_the_worker_keeps_serving(redis_server, client, queue):
    with serving(redis_server.url, queue, step_s=0.01, fail_on_step=3):
        doomed = client.submit("z" * 50, max_tokens=50)
        with pytest.raises(JobFailed) as e:
            client.result(doomed, timeout=10)
        assert e.value.code == "engine_error"
        assert "injected step failure" in e.value.message
        assert client.generate("after", max_tokens=5, timeout=10).text == "after"


def test_a_stream_read_whole_resumed_or_waited_for_gives_the_same_output(redis_server, client, queue):
    text = "streamed, in several reads"
    with serving(redis_server.url, queue, step_s=0.005, stream_interval_s=0.005):
        job_id = client.submit(text, max_tokens=len(text), stream=True)
        deltas = list(client.stream(job_id, timeout=10))
        assert len(deltas) > 2  # published in several events, read as they came
        resumed = list(client.stream(job_id, after=deltas[1].event_id, timeout=10))
        result = client.wait(job_id, timeout=10)
    assert (result.status, result.text) == ("done", text)
    assert "".join(d.text for d in deltas) == text
    assert [t for d in deltas for t in d.token_ids] == result.token_ids
    assert resumed == deltas[2:]


def test_a_failed_jobs_stream_yields_its_deltas_then_raises_job_failed(redis_server, client, queue):
    with serving(redis_server.url, queue, step_s=0.01, fail_on_step=4):
        job_id = client.submit("z" * 50, max_tokens=50, stream=True)
        read = []
        with pytest.raises(JobFailed) as e:
            read.extend(client.stream(job_id, timeout=10))
    assert (e.value.code, e.value.result.text) == ("engine_error", "zzz")  # three steps ran, the fourth failed
    assert "".join(d.text for d in read) == "zzz"


def test_drain_finishes_running_jobs_and_leaves_unread_ones_in_the_stream(redis_server, client, queue, redis_client):
    with serving(
        redis_server.url, queue, step_s=0.01, engine={"max_running": 1, "max_num_batched_tokens": 64}
    ) as worker:
        first = client.submit("a" * 20, max_tokens=20)
        rest = [client.submit("b", max_tokens=1) for _ in range(2)]
        next(iter(client.stream(first, timeout=10)))
        worker.request_stop()
        assert client.result(first, timeout=10).status == "done"
        worker.wait_stopped()
    assert [client.status(j).status for j in rest] == ["queued", "queued"]
    assert redis_client.xlen(KEYS.queue(queue)) == 2
    assert redis_client.xpending(KEYS.queue(queue), GROUP)["pending"] == 0
    assert not redis_client.exists(KEYS.worker(worker.name))
    # With placement its name stays in the worker index, where the others find its own stream
    # (jobs a producer placed on it late are stolen from there); without, it leaves the index too.
    assert redis_client.zrange(KEYS.workers(queue), 0, -1) == [worker.name]


def test_a_worker_without_placement_leaves_the_worker_index_when_it_stops(redis_server, queue, redis_client):
    with serving(redis_server.url, queue, placement=False) as worker:
        assert eventually(lambda: redis_client.zrange(KEYS.workers(queue), 0, -1) == [worker.name])
    assert redis_client.zrange(KEYS.workers(queue), 0, -1) == []


def test_a_job_still_running_when_the_grace_ends_stays_pending(redis_server, client, queue, redis_client):
    with serving(redis_server.url, queue, step_s=0.01, drain_grace_s=0.1) as worker:
        job_id = client.submit("c" * 500, max_tokens=500)
        next(iter(client.stream(job_id, timeout=10)))
        worker.request_stop()
        worker.wait_stopped()
    assert client.status(job_id).status == "running"
    assert redis_client.xpending(KEYS.queue(queue), GROUP)["pending"] == 1


def test_the_worker_deletes_each_done_stream_once_its_readers_have_had_it(
    redis_server, client, queue, redis_client, monkeypatch
):
    """A done stream's own TTL (DONE_TTL_MS, 5 s) is not what removes it: Redis reclaims an expired
    key nobody reads only when its expiry cycle samples it, which among many kept jobs is rare. The
    worker that ended the job deletes it, here 0.5 s after the end (not 5 s), jobs ending over
    several times that; each done stream is there when the job ends, and gone before its TTL."""
    monkeypatch.setattr(done_sweep, "DELAY_S", 0.5)
    with serving(redis_server.url, queue, step_s=0.005):
        ended_at = {}
        for wave in range(4):
            job_ids = [client.submit(f"wave {wave} job {i}", max_tokens=4) for i in range(5)]
            for job_id in job_ids:
                assert client.wait(job_id, timeout=10).status == "done"
            ended_at.update(dict.fromkeys(job_ids, time.monotonic()))
            assert redis_client.exists(KEYS.done(job_ids[-1])) == 1  # ended just now: there for its readers
            time.sleep(0.3)
        # Every done stream goes within the sweep's delay and a publication round or two: long
        # before the TTL of 5 s that each still carries until then.
        assert eventually(lambda: redis_client.exists(*(KEYS.done(j) for j in ended_at)) == 0, timeout=3)
        assert time.monotonic() - min(ended_at.values()) < 4.5
        assert all(redis_client.hget(KEYS.job(j), "status") == "done" for j in ended_at)


def test_a_worker_with_room_for_more_reads_flex_read_batch_flex_entries_an_iteration(redis_server, queue):
    """200 flex jobs wait before the worker starts, with room for 256: it starts them
    FLEX_READ_BATCH an iteration (the jobs admitted together share their start time), so no
    iteration's admission of flex jobs holds back a default or priority job for long."""
    with Client(redis_server.url, queue, tenant="batch") as client:
        ids = client.submit_many([{"prompt": "x", "max_tokens": 2, "service_tier": "flex"}] * 200)
        with serving(redis_server.url, queue):
            results = client.results(ids, timeout=30)
    started_together = Counter(r.timings.started_at for r in results)
    batches = [FLEX_READ_BATCH] * (200 // FLEX_READ_BATCH) + [200 % FLEX_READ_BATCH]
    assert sorted(started_together.values(), reverse=True) == batches


class PaceTimer:
    """The flex pace's clock in a test: it moves only when the engine steps or parses a prompt."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_echo_engine(timer: PaceTimer, device_s: float, parse_s: float) -> type[HoldingEchoEngine]:
    """An echo engine whose every step takes `device_s` on `timer` (the wait for a device) and every
    prompt's parse `parse_s`: the flex pace's measures, given."""

    class TimedEchoEngine(HoldingEchoEngine):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            encode = self.tokenizer.encode

            def parse(text, *args, **kwargs):
                timer.now += parse_s
                return encode(text, *args, **kwargs)

            self.tokenizer.encode = parse  # type: ignore[method-assign]

        def step(self):
            timer.now += device_s
            return super().step()

    return TimedEchoEngine


@pytest.mark.parametrize(
    ("device_s", "batch"),
    [(0.050, FLEX_READ_BATCH), (0.0005, FLEX_YIELD_BATCH)],
    ids=["a-long-step-hides-the-admissions", "a-host-bound-loop-yields"],
)
def test_flex_entries_read_while_a_default_job_runs_fit_in_an_engine_step(redis_server, queue, device_s, batch):
    """A default job runs (held) while 64 flex jobs wait; each prompt's parse takes 1 ms. With 50 ms
    engine steps far more admissions than a read takes fit in one and flex keeps reading
    FLEX_READ_BATCH an iteration; with 0.5 ms steps two fit in STEP_MULTIPLE (4) of them and it reads
    FLEX_YIELD_BATCH, so that an arriving default job waits for fewer of them. The first two reads come before the pace has measured an admission of flex
    entries alone."""
    timer = PaceTimer()
    engine_class = timed_echo_engine(timer, device_s, parse_s=0.001)
    with Client(redis_server.url, queue, tenant="batch") as client:
        chat = client.as_tenant("chat").submit("x" * 200, max_tokens=200)
        ids = client.submit_many([{"prompt": "x", "max_tokens": 2, "service_tier": "flex"}] * 64)
        with serving(redis_server.url, queue, engine_class=engine_class, timer=timer) as worker:
            results = client.results(ids, timeout=30)
            worker.engine.release()
            assert client.result(chat, timeout=10).status == "done"
    started_together = Counter(r.timings.started_at for r in results)
    sizes = [started_together[at] for at in sorted(started_together)]
    assert sizes[:2] == [FLEX_READ_BATCH - 1, FLEX_READ_BATCH]  # the first read took the default job too
    rest = len(ids) - sum(sizes[:2])
    assert sizes[2:] == [batch] * (rest // batch) + [rest % batch]


def test_a_worker_reads_default_entries_up_to_its_room_at_once(redis_server, queue):
    """The flex batch bounds flex alone: 200 default jobs, of a tenant's lane stream and of the
    queue's own, start in the worker's first iteration (a bulk load keeps whole reads)."""
    with Client(redis_server.url, queue) as client:
        ids = client.as_tenant("team-a").submit_many([{"prompt": "x", "max_tokens": 2}] * 100)
        ids += client.submit_many([{"prompt": "x", "max_tokens": 2}] * 100)
        with serving(redis_server.url, queue):
            results = client.results(ids, timeout=30)
    assert Counter(r.timings.started_at for r in results).most_common(1)[0][1] == 200


def test_a_default_job_is_read_while_ended_flex_jobs_hold_every_slot(redis_server, queue):
    """With wait_replicas 1 and no replica Redis never confirms a result (the worker has written it
    and waits again), so 4 flex jobs that ended keep their entries pending on a worker of 4 slots,
    as the ends of a publication round that Redis is slow to answer do. A default job is read and
    served all the same: a job that ended holds no engine slot, and counts against the room of its
    own lane and the lower ones only."""
    with Client(redis_server.url, queue, tenant="batch") as client:
        with serving(redis_server.url, queue, wait_replicas=1, wait_timeout_ms=20, engine={"max_running": 4}):
            flex = client.submit_many([{"prompt": "x", "max_tokens": 2, "service_tier": "flex"}] * 4)
            assert [r.status for r in client.results(flex, timeout=30)] == ["done"] * 4
            job = client.as_tenant("chat").submit("yz", max_tokens=2)
            assert client.result(job, timeout=10).text == "yz"
