"""The Batch API through the official `openai` SDK, against real gateway processes, two echo
workers and a real redis-server: files in and out, a batch's statuses and counts, and every
custom_id answered exactly once whatever dies or is cancelled on the way."""

from __future__ import annotations

import contextlib
import io
import json
import re
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from openai.types import Batch

from gateway.batch.store import PIECE_CHARS
from harness.polling import eventually
from openai_format.batch_lines import line_request, parse_line, request_id
from producer_client.keys import Keys
from producer_client.protocol.batch import LINES_PER_FIELD
from producer_client.schema import MAX_TOKENS_LIMIT
from producer_client.waiting import UNENDED
from tests.support.gateways import GatewayProcess, slowest_answer_while
from tests.support.jobs import entries_added
from tests.support.workers import echo_workers
from worker.embedded_redis import EmbeddedRedis, free_port

KEYS = Keys()
MODEL = "batch-echo"
IN_FLIGHT = 16  # lines a batch has out at once: the batches below cycle it many times
MAX_LINES = 600
MAX_FILE_BYTES = 8 * PIECE_CHARS
RUN_TIMEOUT_S = 180
ENDED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def redis_server():
    """This module's own redis-server, in place of the session's. Every gateway on a Redis drives
    the batches it finds there, and the session's gateway (tests/gateway/conftest.py), when this
    process has started it, serves other models: driving a batch of this module, it answered every
    line model_not_found."""
    with EmbeddedRedis(port=free_port()) as server:
        yield server


@pytest.fixture(scope="module")
def batch_queue():
    return f"batch-{uuid.uuid4().hex[:8]}"


# An endless line's answer: far more steps than any test here waits, on any machine. The echo
# engine's step no longer waits for Redis (its tokens are published in pieces), so the length of
# a prompt echoed back no longer bounds a line's time: a token script says this instead.
ENDLESS = "endless line"
ENDLESS_TOKENS = MAX_TOKENS_LIMIT  # the most a request may ask for: a line of this many steps


@pytest.fixture(scope="module")
def batch_workers(redis_server, batch_queue, tmp_path_factory):
    """Two echo workers of 4 slots each, quick to reclaim a killed one's jobs, that answer a line
    saying ENDLESS with ENDLESS_TOKENS bytes."""
    log_dir = tmp_path_factory.mktemp("batch-workers")
    script = log_dir / "endless.json"
    script.write_text(json.dumps([{"when": ENDLESS, "say": "x" * ENDLESS_TOKENS}]))
    flags = (
        "--max-running",
        "4",
        "--claim-idle-ms",
        "1000",
        "--reclaim-interval-s",
        "0.2",
        "--max-model-len",
        str(2 * ENDLESS_TOKENS),
        "--num-pages",
        str(ENDLESS_TOKENS),
    )
    with echo_workers(redis_server.url, batch_queue, log_dir, *flags, env={"MILI_ECHO_SCRIPT": str(script)}) as workers:
        yield workers


def gateway_flags(batch_queue: str, *more: str) -> tuple[str, ...]:
    return (
        "--models",
        json.dumps({MODEL: batch_queue}),
        "--batch-poll-s",
        "0.1",
        "--batch-lease-s",
        "1",
        "--batch-in-flight",
        str(IN_FLIGHT),
        "--batch-max-lines",
        str(MAX_LINES),
        "--batch-max-file-bytes",
        str(MAX_FILE_BYTES),
        "--batch-completion-windows",
        json.dumps(["24h", "4s"]),
        *more,
    )


@contextlib.contextmanager
def private_gateway(
    tmp_path: Path, *flags: str, api_key: str = "unused", max_retries: int = 0
) -> Iterator[tuple[redis.Redis, GatewayProcess, openai.OpenAI]]:
    """A gateway on a Redis of its own, a client of that Redis with every right, and the official
    SDK on the gateway: for the tests that write under the Batch API's keys what the module's
    gateways and batches must not meet (keys of another type)."""
    with EmbeddedRedis(port=free_port()) as server:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        gateway = GatewayProcess(server.url, tmp_path, *flags).start()
        sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=api_key, max_retries=max_retries)
        try:
            yield admin, gateway, sdk
        finally:
            sdk.close()
            gateway.stop()
            admin.close()


@pytest.fixture(scope="module")
def gateway(redis_server, batch_queue, batch_workers, tmp_path_factory):
    """This module's gateway, in place of the session's (conftest's `sdk` then talks to it)."""
    process = GatewayProcess(redis_server.url, tmp_path_factory.mktemp("batch-gateway"), *gateway_flags(batch_queue))
    try:
        yield process.start()
    finally:
        process.stop()


def chat_line(custom_id: str, content: str, max_tokens: int = 64, **body) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **body},
    }


def echo_of(content: str) -> str:
    """What the echo engine answers a chat: its template's text, one byte a step."""
    return f"user: {content}\nassistant: "


def upload(sdk, lines: list) -> str:
    text = "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    return sdk.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch").id


def run_batch(sdk, lines: list, window: str = "24h"):
    return sdk.batches.create(
        input_file_id=upload(sdk, lines), endpoint="/v1/chat/completions", completion_window=window
    )


def wait_for(sdk, batch_id: str, condition, timeout: float = RUN_TIMEOUT_S):
    def reached():
        batch = sdk.batches.retrieve(batch_id)
        return batch if condition(batch) else None

    batch = eventually(reached, timeout, interval=0.1)
    assert batch, stuck(sdk, batch_id)
    return batch


def stuck(sdk, batch_id: str) -> str:
    """What a batch that did not get where a test waited for it is, with its first errors."""
    batch = sdk.batches.retrieve(batch_id)
    errors = sdk.files.content(batch.error_file_id).text.splitlines()[:3] if batch.error_file_id else []
    return f"batch {batch_id} stuck: {batch}; first errors: {errors}"


def ended(sdk, batch_id: str):
    return wait_for(sdk, batch_id, lambda b: b.status in ENDED)


def answers(sdk, file_id: str | None) -> dict[str, dict]:
    """The file's answers by custom_id; a custom_id twice fails the test."""
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id answered twice"
    return by_id


SLOW_LINE = "x" * 1995  # echoed back a byte a step: a line of about 2,000 steps


def slow_lines(prefix: str, n: int) -> list[dict]:
    """Lines of 2,000-byte prompts: 2,000 engine steps each, seconds for the whole batch on the
    workers' 8 slots (a step of the echo engine costs tens of microseconds, Redis not waited for)."""
    return [chat_line(f"{prefix}{i}", f"{i:04d} " + SLOW_LINE, max_tokens=2100) for i in range(n)]


def quick_then_endless(prefix: str, n: int, quick: int) -> list[dict]:
    """`quick` lines of a few steps, then endless ones (ENDLESS_TOKENS steps each), so a test that
    ends the batch early finds the quick ones done and the rest not."""
    lines = [chat_line(f"{prefix}{i}", "hi") for i in range(quick)]
    return lines + [chat_line(f"{prefix}{i}", ENDLESS, max_tokens=ENDLESS_TOKENS) for i in range(quick, n)]


def test_the_sdk_uploads_runs_and_downloads_a_batch(sdk, redis_client, batch_queue):
    n = 4 * LINES_PER_FIELD + 5  # the batch keeps its lines in runs of LINES_PER_FIELD; IN_FLIGHT at a time
    lines = [chat_line(f"r{i}", f"hello {i}") for i in range(n)]
    lines += [
        chat_line("two", "both", n=2, seed=7),
        chat_line("cold", "x", temperature=-1),
        {**chat_line("nobody", "x"), "body": {**chat_line("nobody", "x")["body"], "model": "no-such-model"}},
    ]
    added_before = entries_added(redis_client, batch_queue)
    created = run_batch(sdk, lines)
    assert created.status == "validating" and created.endpoint == "/v1/chat/completions"
    batch = ended(sdk, created.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (
        len(lines),
        len(lines) - 2,
        2,
    )
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    assert batch.expires_at == batch.created_at + 24 * 3600

    done = answers(sdk, batch.output_file_id)
    assert set(done) == {f"r{i}" for i in range(n)} | {"two"}
    assert all(
        done[f"r{i}"]["response"]["body"]["choices"][0]["message"]["content"] == echo_of(f"hello {i}") for i in range(n)
    )
    assert done["r0"]["response"]["status_code"] == 200 and done["r0"]["error"] is None
    assert [c["index"] for c in done["two"]["response"]["body"]["choices"]] == [0, 1]
    failed = answers(sdk, batch.error_file_id)
    assert {k: (a["response"]["status_code"], a["response"]["body"]["error"]["code"]) for k, a in failed.items()} == {
        "cold": (400, "decimal_below_min_value"),
        "nobody": (404, "model_not_found"),
    }
    output = sdk.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.bytes == len(sdk.files.content(batch.output_file_id).content)
    # Each line's jobs were enqueued once: n single jobs and the two of `two`.
    assert entries_added(redis_client, batch_queue) - added_before == n + 2


def driving_gateway(sdk, redis_client, batch_id: str, gateways: list[GatewayProcess]) -> tuple[int, str]:
    """Once the batch is well under way: which of `gateways` holds its lease, and the lease's value."""
    wait_for(sdk, batch_id, lambda b: b.request_counts.completed >= 5)
    holder = redis_client.get(KEYS.batch_lease(batch_id))
    return next(i for i, gw in enumerate(gateways) if f"-{gw.process.pid}-" in holder), holder


def test_a_killed_worker_and_killed_gateways_lose_no_line(
    redis_server, redis_client, batch_queue, batch_workers, gateway, tmp_path
):
    """Three gateways drive batches; the one driving this batch is killed (kill -9), and so is a
    worker, mid-batch; the killed gateway starts again. The batch completes, each line once."""
    extra = [
        GatewayProcess(redis_server.url, tmp_path, *gateway_flags(batch_queue), name=f"gw-{i}").start()
        for i in range(2)
    ]
    gateways = [gateway, *extra]
    sdks = [openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) for gw in gateways]
    victim_worker = batch_workers[0]
    try:
        n = 120
        batch = run_batch(sdks[0], slow_lines("k", n))
        driver, _ = driving_gateway(sdks[0], redis_client, batch.id, gateways)
        victim_worker.kill()
        gateways[driver].kill()
        time.sleep(1.5)  # past the lease: the other gateway takes the batch on
        gateways[driver].start()
        done = ended(sdks[(driver + 1) % len(gateways)], batch.id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
        output = answers(sdks[driver], done.output_file_id)
        assert set(output) == {f"k{i}" for i in range(n)}
        assert all(
            output[f"k{i}"]["response"]["body"]["choices"][0]["message"]["content"] == echo_of(f"{i:04d} " + SLOW_LINE)
            for i in range(n)
        )
        assert done.error_file_id is None
    finally:
        for client in sdks:
            client.close()
        for gw in extra:
            gw.stop()
        victim_worker.stop()
        victim_worker.start().wait_ready()


def test_a_gateway_stopped_gracefully_hands_its_batch_over_at_once(
    redis_server, redis_client, batch_queue, gateway, tmp_path
):
    """With 60 s leases, a SIGTERM'd gateway's lease is gone as it exits (not left to lapse), and
    another gateway finishes its batch."""
    gateways: list[GatewayProcess] = []
    sdks: list[openai.OpenAI] = []
    try:
        gateway.terminate()  # the module's gateway (1 s leases) sits this one out
        flags = gateway_flags(batch_queue, "--batch-lease-s", "60")
        gateways += [GatewayProcess(redis_server.url, tmp_path, *flags, name=f"calm-{i}").start() for i in range(2)]
        sdks += [openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0) for gw in gateways]
        n = 60
        batch = run_batch(sdks[0], slow_lines("g", n))
        driver, holder = driving_gateway(sdks[0], redis_client, batch.id, gateways)
        gateways[driver].terminate()
        assert "Application shutdown complete." in gateways[driver].log()  # a graceful stop
        assert redis_client.get(KEYS.batch_lease(batch.id)) != holder
        done = ended(sdks[1 - driver], batch.id)
        assert done.status == "completed"
        assert set(answers(sdks[1 - driver], done.output_file_id)) == {f"g{i}" for i in range(n)}
    finally:
        for client in sdks:
            client.close()
        for gw in gateways:
            gw.stop()
        gateway.start()


def test_lines_wait_for_room_in_a_full_queue_and_are_answered_once(
    redis_server, redis_client, batch_queue, gateway, tmp_path
):
    """A gateway whose queue bound (3 jobs) is far below the lines a batch has out (IN_FLIGHT):
    it submits what fits, again and again, lines of two choices straddling the bound; every line
    is answered once, and no job is enqueued twice. Placement off: the bound is the shared
    stream's, which placement bypasses while workers have room."""
    flags = gateway_flags(batch_queue, "--max-queue-depth", "3", "--no-placement")
    bounded = GatewayProcess(redis_server.url, tmp_path, *flags, name="bounded")
    sdk = openai.OpenAI(base_url=f"{bounded.url}/v1", api_key="unused", max_retries=0)
    try:
        gateway.terminate()  # the module's gateway, unbounded, sits this one out
        bounded.start()
        n = 16  # 24 jobs: the bound is met about 8 times, each refusal waited out for QUEUE_FULL_WAIT_S
        choices = [1 + i % 2 for i in range(n)]
        before = entries_added(redis_client, batch_queue)
        done = ended(sdk, run_batch(sdk, [chat_line(f"q{i}", f"room {i}", n=choices[i]) for i in range(n)]).id)
        assert done.status == "completed", done
        assert (done.request_counts.completed, done.request_counts.failed) == (n, 0)
        output = answers(sdk, done.output_file_id)
        assert {
            cid: [c["message"]["content"] for c in a["response"]["body"]["choices"]] for cid, a in output.items()
        } == {f"q{i}": [echo_of(f"room {i}")] * choices[i] for i in range(n)}
        assert entries_added(redis_client, batch_queue) - before == sum(choices)
        assert "is full; line" in bounded.log()  # the runs met the bound, and waited
    finally:
        sdk.close()
        bounded.stop()
        gateway.start()


def jobs_out(redis_client, job_ids: list[str]) -> int:
    """How many of `job_ids` Redis holds queued or running."""
    pipe = redis_client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(KEYS.job(job_id), "status")
    return sum(status in UNENDED for status in pipe.execute())


def jobs_ended(redis_client, job_ids: list[str]) -> int:
    """How many of `job_ids` Redis holds ended."""
    pipe = redis_client.pipeline(transaction=False)
    for job_id in job_ids:
        pipe.hget(KEYS.job(job_id), "status")
    return sum(status is not None and status not in UNENDED for status in pipe.execute())


def test_a_batch_keeps_at_most_its_in_flight_bytes_of_jobs_in_redis(
    redis_server, redis_client, batch_queue, gateway, tmp_path
):
    """Lines of 20,000-byte prompts against a bound of 70,000 bytes of jobs: however many lines
    batch_in_flight allows (IN_FLIGHT), at most three lines' jobs are queued or running at once,
    as Redis's job hashes say, and every line is answered."""
    prompt_bytes, bound, n = 20_000, 70_000, 12
    flags = gateway_flags(batch_queue, "--batch-in-flight-bytes", str(bound))
    bounded = GatewayProcess(redis_server.url, tmp_path, *flags, name="bytes-bounded")
    sdk = openai.OpenAI(base_url=f"{bounded.url}/v1", api_key="unused", max_retries=0)
    try:
        gateway.terminate()  # the module's gateway, of no byte bound this low, sits this one out
        bounded.start()
        lines = [chat_line(f"b{i}", f"{i:04d} " + "y" * prompt_bytes, max_tokens=2100) for i in range(n)]
        batch = run_batch(sdk, lines)
        job_ids = [request_id(batch.id, line["custom_id"], line["body"]) + "-0" for line in lines]
        most = 0
        while sdk.batches.retrieve(batch.id).status not in ENDED:
            most = max(most, jobs_out(redis_client, job_ids))
            time.sleep(0.01)
        done = ended(sdk, batch.id)
        assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", n, 0)
        assert set(answers(sdk, done.output_file_id)) == {line["custom_id"] for line in lines}
        assert 2 <= most and most * prompt_bytes <= bound, most  # a job's body holds its prompt and more
    finally:
        sdk.close()
        bounded.stop()
        gateway.start()


def gauge(url: str, name: str) -> float:
    """A gauge of the gateway's GET /metrics."""
    found = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.MULTILINE)
    assert found, name
    return float(found.group(1))


def test_batches_driven_at_once_keep_at_most_the_gateways_in_flight_bytes_and_each_progresses(
    redis_server, redis_client, batch_queue, gateway, tmp_path
):
    """Four batches of lines of 20,000-byte prompts, started at once on one gateway: each batch may
    have three lines out (batch_in_flight_bytes 70,000), the gateway four in all
    (batch_gateway_in_flight_bytes 100,000). Redis's job hashes and the gateway's gauge stay within
    the gateway's bound (each batch held its own, twelve lines in all), every batch has a line out
    before any batch has all of its answered (none waits for another to end), and every line is
    answered with its own echo."""
    prompt_bytes, per_batch, bound, batches, n = 20_000, 70_000, 100_000, 4, 8
    flags = gateway_flags(
        batch_queue, "--batch-in-flight-bytes", str(per_batch), "--batch-gateway-in-flight-bytes", str(bound)
    )
    bounded = GatewayProcess(redis_server.url, tmp_path, *flags, name="gateway-bytes-bounded")
    sdk = openai.OpenAI(base_url=f"{bounded.url}/v1", api_key="unused", max_retries=0)
    try:
        gateway.terminate()  # the module's gateway, of no byte bound this low, sits this one out
        bounded.start()
        inputs = {}
        for b in range(batches):
            lines = [chat_line(f"{b}-{i}", f"{b}-{i:04d} " + "y" * prompt_bytes, max_tokens=2100) for i in range(n)]
            inputs[upload(sdk, lines)] = lines
        created = {
            sdk.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ).id: lines
            for file_id, lines in inputs.items()
        }
        job_ids = {
            batch_id: [request_id(batch_id, line["custom_id"], line["body"]) + "-0" for line in lines]
            for batch_id, lines in created.items()
        }
        most, most_gauge, started = 0, 0.0, set()
        while any(sdk.batches.retrieve(batch_id).status not in ENDED for batch_id in created):
            out = {batch_id: jobs_out(redis_client, ids) for batch_id, ids in job_ids.items()}
            ended_here = {batch_id: jobs_ended(redis_client, ids) for batch_id, ids in job_ids.items()}
            if all(ended < n for ended in ended_here.values()):
                started |= {batch_id for batch_id in created if out[batch_id] or ended_here[batch_id]}
            most = max(most, sum(out.values()))
            most_gauge = max(most_gauge, gauge(bounded.url, "mili_gateway_batch_in_flight_bytes"))
            time.sleep(0.01)
        for batch_id, lines in created.items():
            done = ended(sdk, batch_id)
            assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", n, 0)
            got = answers(sdk, done.output_file_id)
            assert {
                line["custom_id"]: got[line["custom_id"]]["response"]["body"]["choices"][0]["message"]["content"]
                for line in lines
            } == {line["custom_id"]: echo_of(line["body"]["messages"][0]["content"])[:2100] for line in lines}
        assert 2 <= most and most * prompt_bytes <= bound, most  # a job's body holds its prompt and more
        assert 0 < most_gauge <= bound, most_gauge
        assert started == set(created), "a batch had no line out before another had all of its answered"
        assert gauge(bounded.url, "mili_gateway_batch_in_flight_bytes") == 0
    finally:
        sdk.close()
        bounded.stop()
        gateway.start()


def checking_time_s(lines: list[dict]) -> float:
    """How long checking the lines as the gateway checks a batch's lines takes here, now."""
    started = time.monotonic()
    for number, line in enumerate(lines, 1):
        line_request(parse_line(json.dumps(line), number), number)
    return time.monotonic() - started


def test_a_batch_of_long_lines_holds_no_other_request(redis_server, batch_queue, gateway, tmp_path):
    """Six lines of 30,000 messages each (1 MB): checking one as the HTTP API checks a body takes
    0.2-0.3 s of CPU, and the driver checked the lines it read on the event loop, every other
    request of the gateway held meanwhile. GET /v1/models, asked every few milliseconds while the
    batch runs, now waits for less than half of what checking its lines takes (timed in this
    process just before): on the loop it waited 1.3-1.5 times as long, now 0.1-0.25 times (the
    rest: the interpreter's collections of the lines' objects, which hold the GIL).
    The lines are answered: the echo worker's context refuses them."""
    n, messages = 6, [{"role": "user", "content": "a"}] * 30_000
    lines = [{**chat_line(f"long{i}", ""), "body": {"model": MODEL, "messages": messages}} for i in range(n)]
    flags = gateway_flags(batch_queue, "--batch-max-file-bytes", str(16 << 20))
    big_files = GatewayProcess(redis_server.url, tmp_path, *flags, name="gateway-big-files")
    sdk = openai.OpenAI(base_url=f"{big_files.url}/v1", api_key="unused", max_retries=0)
    try:
        gateway.terminate()  # the module's gateway, whose files are smaller, sits this one out
        big_files.start()
        file_id = upload(sdk, lines)

        def run() -> Batch:
            created = sdk.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            return ended(sdk, created.id)

        checking_s = checking_time_s(lines)
        done, _, slowest = slowest_answer_while(big_files.url, run, "/v1/models")
        assert isinstance(done, Batch) and done.status == "completed", done
        assert set(answers(sdk, done.error_file_id)) == {line["custom_id"] for line in lines}
        assert slowest < checking_s / 2, (slowest, checking_s)
    finally:
        sdk.close()
        big_files.stop()
        gateway.start()


def test_a_cancelled_batch_keeps_what_finished_and_gives_up_the_rest(sdk):
    n = 150
    batch = run_batch(sdk, quick_then_endless("c", n, quick=12))
    wait_for(sdk, batch.id, lambda b: b.request_counts.completed >= 10)
    cancelling = sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at is not None
    done = ended(sdk, batch.id)
    assert done.status == "cancelled" and done.cancelled_at >= done.cancelling_at
    finished, given_up = answers(sdk, done.output_file_id), answers(sdk, done.error_file_id)
    assert set(finished) | set(given_up) == {f"c{i}" for i in range(n)} and not set(finished) & set(given_up)
    assert len(finished) >= 10 and len(given_up) > 0
    assert {a["error"]["code"] for a in given_up.values()} == {"batch_cancelled"}
    assert (done.request_counts.completed, done.request_counts.failed) == (len(finished), len(given_up))
    with pytest.raises(openai.BadRequestError):  # not a 409, which the SDK would retry
        sdk.batches.cancel(run_and_finish(sdk).id)


def run_and_finish(sdk):
    return ended(sdk, run_batch(sdk, [chat_line("only", "one")]).id)


def test_a_batch_past_its_window_expires_with_what_finished(sdk):
    n = 200
    batch = run_batch(sdk, quick_then_endless("e", n, quick=8), window="4s")
    done = ended(sdk, batch.id)
    assert done.status == "expired" and done.expired_at >= done.expires_at == done.created_at + 4
    finished, given_up = answers(sdk, done.output_file_id), answers(sdk, done.error_file_id)
    assert set(finished) | set(given_up) == {f"e{i}" for i in range(n)} and not set(finished) & set(given_up)
    assert finished and given_up
    assert {a["error"]["code"] for a in given_up.values()} == {"batch_expired"}


def test_a_bad_line_fails_the_batch_in_validation_naming_the_lines(sdk):
    lines = [
        chat_line("a", "x"),
        chat_line("b", "y"),
        "{not json",
        chat_line("c", "z"),
        {**chat_line("d", "w"), "url": "/v1/completions"},
        chat_line("e", "v"),
        chat_line("a", "again"),
    ]
    done = ended(sdk, run_batch(sdk, lines).id)
    assert done.status == "failed" and done.failed_at is not None and done.output_file_id is None
    assert [(e.line, e.code) for e in done.errors.data] == [
        (3, "invalid_json"),
        (5, "invalid_url"),
        (7, "duplicate_custom_id"),
    ]


def test_a_file_that_begins_with_a_byte_order_mark_runs_every_line(sdk):
    """Notepad, PowerShell and Excel save UTF-8 with a byte order mark: it failed line 1 as
    invalid_json. It is no part of the file's lines; the file comes back as it was uploaded."""
    text = "\ufeff" + "".join(json.dumps(chat_line(f"m{i}", f"marked {i}")) + "\n" for i in range(3))
    file_id = sdk.files.create(file=("bom.jsonl", io.BytesIO(text.encode())), purpose="batch").id
    batch = ended(
        sdk, sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h").id
    )
    assert batch.status == "completed" and batch.errors is None, batch
    done = answers(sdk, batch.output_file_id)
    assert {k: a["response"]["body"]["choices"][0]["message"]["content"] for k, a in done.items()} == {
        f"m{i}": echo_of(f"marked {i}") for i in range(3)
    }
    assert sdk.files.content(file_id).content == text.encode()


@pytest.mark.parametrize("text", ["\n\n  \n", "\ufeff\n\r\n"])
def test_a_batch_of_a_file_with_no_request_is_refused_naming_the_file(sdk, text):
    """A file of blank lines only was taken, and its batch `completed` with 0 requests. OpenAI's
    reference says nothing of such a file, so its batch is refused at creation, as an input file
    that is not a batch file is: a 400 naming input_file_id."""
    file_id = sdk.files.create(file=("blank.jsonl", io.BytesIO(text.encode())), purpose="batch").id
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    assert (refused.value.code, refused.value.param) == ("empty_file", "input_file_id"), refused.value.body
    assert file_id in refused.value.message
    assert all(b.input_file_id != file_id for b in sdk.batches.list(limit=100))


def test_files_are_refused_and_found_as_the_api_says(sdk, gateway):
    with pytest.raises(openai.BadRequestError, match="purpose"):
        sdk.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="exceeds"):
        sdk.files.create(file=("x.jsonl", io.BytesIO(b"x" * (MAX_FILE_BYTES + 1))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="limit"):
        sdk.files.create(file=("x.jsonl", io.BytesIO(b"{}\n" * (MAX_LINES + 1))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="UTF-8"):
        sdk.files.create(file=("x.jsonl", io.BytesIO(b"\xff\xfe\n")), purpose="batch")
    for call in (sdk.files.retrieve, sdk.files.content, sdk.files.delete):
        with pytest.raises(openai.NotFoundError):
            call("file-" + "0" * 32)
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve("file-{braces}")
    with pytest.raises(openai.NotFoundError):
        sdk.batches.retrieve("batch_" + "0" * 32)

    file_id = upload(sdk, [chat_line("a", "x")])
    for endpoint, window, param in (
        ("/v1/embeddings", "24h", "endpoint"),
        ("/v1/chat/completions", "1h", "completion_window"),
    ):
        with pytest.raises(openai.BadRequestError, match=param):
            sdk.batches.create(input_file_id=file_id, endpoint=endpoint, completion_window=window)
    assert sdk.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(file_id)
    with pytest.raises(openai.BadRequestError, match="input_file_id"):
        sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")


@pytest.mark.parametrize(
    "path, limit, code",
    [
        ("/v1/files", 0, "integer_below_min_value"),
        ("/v1/files", 10_001, "integer_above_max_value"),
        ("/v1/batches", 0, "integer_below_min_value"),
        ("/v1/batches", 101, "integer_above_max_value"),
    ],
)
def test_a_listings_limit_out_of_its_range_is_a_400_with_openais_code_for_the_bound(gateway, path, limit, code):
    """A body's integer past a bound is integer_below_min_value or integer_above_max_value, OpenAI's
    codes (docs/http-api.md); a listing's limit was invalid_value."""
    response = httpx.get(f"{gateway.url}{path}", params={"limit": limit})
    assert response.status_code == 400, response.text
    assert response.json()["error"] | {"message": None} == {
        "message": None,
        "type": "invalid_request_error",
        "param": "limit",
        "code": code,
    }


def test_a_file_of_several_pieces_comes_back_byte_for_byte(sdk):
    line = json.dumps(chat_line("big", "é" * 3000), ensure_ascii=False) + "\n"  # two bytes a character
    text = line * (int(3.5 * PIECE_CHARS) // len(line))
    file = sdk.files.create(file=("big.jsonl", io.BytesIO(text.encode())), purpose="batch")
    assert file.bytes == len(text.encode()) and file.filename == "big.jsonl"
    assert sdk.files.content(file.id).content == text.encode()


def test_batches_are_listed_newest_first_page_by_page(sdk):
    ids = [run_batch(sdk, [chat_line("l", f"list {i}")]).id for i in range(5)]
    seen, after = [], None
    while True:
        page = sdk.batches.list(limit=2, after=after) if after else sdk.batches.list(limit=2)
        seen += [b.id for b in page.data]
        if not page.has_more:
            break
        after = page.data[-1].id
    assert [i for i in seen if i in ids] == ids[::-1]


def test_files_and_ended_batches_expire_after_batch_ttl_s(
    redis_server, redis_client, batch_queue, batch_workers, tmp_path
):
    ttl_s = 2
    gateway = GatewayProcess(
        redis_server.url, tmp_path, *gateway_flags(batch_queue, "--batch-ttl-s", str(ttl_s))
    ).start()
    sdk = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    try:
        batches = [run_batch(sdk, [chat_line(f"t{i}", "ttl")]) for i in range(3)]
        done = [ended(sdk, b.id) for b in batches]
        assert all(b.status == "completed" for b in done)
        files = [b.input_file_id for b in done] + [b.output_file_id for b in done]
        time.sleep(3 * ttl_s)
        for file_id in files:
            with pytest.raises(openai.NotFoundError):
                sdk.files.retrieve(file_id)
        for b in done:
            with pytest.raises(openai.NotFoundError):
                sdk.batches.retrieve(b.id)
            assert not redis_client.exists(
                KEYS.file_content(b.output_file_id), KEYS.batch_output(b.id), KEYS.batch_input(b.id)
            )
        assert not {b.id for b in done} & {b.id for b in sdk.batches.list(limit=100).data}
    finally:
        sdk.close()
        gateway.stop()


def test_an_uploads_expires_after_is_when_it_expires(sdk, redis_client):
    """OpenAI's files.create takes `expires_after` (1 hour to 30 days after the upload): it was
    accepted and ignored, the file kept for batch_ttl_s and saying so in its expires_at."""
    policy = {"anchor": "created_at", "seconds": 3600}
    file = sdk.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=policy)
    assert file.expires_at == file.created_at + 3600
    assert sdk.files.retrieve(file.id).expires_at == file.created_at + 3600
    assert 3500 < redis_client.ttl(KEYS.file(file.id)) <= 3600
    assert 3500 < redis_client.ttl(KEYS.file_content(file.id)) <= 3600
    for bad, param in (
        ({"anchor": "created_at", "seconds": 60}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": 2_592_001}, "expires_after.seconds"),
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            sdk.files.create(file=("x.jsonl", io.BytesIO(b"{}\n")), purpose="batch", expires_after=bad)
        assert refused.value.param == param, refused.value.body


def test_a_batchs_output_expires_after_is_when_its_output_files_expire(sdk, redis_client):
    """OpenAI's batches.create takes `output_expires_after`: it was refused as a field the spec
    does not have (400 unknown_parameter)."""
    created = sdk.batches.create(
        input_file_id=upload(sdk, [chat_line("o", "out")]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    batch = ended(sdk, created.id)
    assert batch.status == "completed", batch
    output = sdk.files.retrieve(batch.output_file_id)
    assert output.expires_at == output.created_at + 7200
    assert 7000 < redis_client.ttl(KEYS.file(output.id)) <= 7200
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.batches.create(
            input_file_id=batch.input_file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            output_expires_after={"anchor": "created_at", "seconds": 60},
        )
    assert refused.value.param == "output_expires_after.seconds" and refused.value.code == "integer_below_min_value"


def test_an_upload_of_a_field_given_twice_is_refused_naming_it_and_stores_nothing(gateway):
    """Two `file` parts stored the last and dropped the first, unsaid; a field given twice is now a
    400 naming it, and no file is stored."""
    first, second = ("file", ("a.jsonl", b"{}\n")), ("file", ("b.jsonl", b"{}\n{}\n"))
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        stored = http.get("/v1/files").json()["data"]
        for form, files, param in (
            ({"purpose": "batch"}, [first, second], "file"),
            ({"purpose": ["batch", "batch"]}, [first], "purpose"),
        ):
            answer = http.post("/v1/files", data=form, files=files)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"] == {
                "message": f"{param}: given 2 times: an upload takes one",
                "type": "invalid_request_error",
                "param": param,
                "code": "invalid_value",
            }
        assert http.get("/v1/files").json()["data"] == stored


def test_a_form_or_query_parameter_refused_is_named_with_openais_code(gateway):
    """A missing upload field or a listing's malformed query was a 400 `invalid_value` naming no
    field ("Field required"), where a JSON body's is `missing_required_parameter` naming it."""
    with httpx.Client(base_url=gateway.url, timeout=30) as http:
        for form, files, param in (
            (None, {"file": ("x.jsonl", b"{}\n")}, "purpose"),
            ({"purpose": "batch"}, None, "file"),
        ):
            answer = http.post("/v1/files", data=form, files=files)
            assert answer.status_code == 400, answer.text
            assert answer.json()["error"] | {"message": None} == {
                "message": None,
                "type": "invalid_request_error",
                "param": param,
                "code": "missing_required_parameter",
            }
        for path in ("/v1/files?limit=ten", "/v1/batches?limit=ten"):
            answer = http.get(path)
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "limit", answer.text


def test_an_index_of_another_type_is_a_500_not_retried_and_the_rest_is_served(tmp_path):
    """The Batch API's indexes (mili:files, mili:batches, which the gateway's user alone writes)
    holding another type: listing, uploading, creating a batch were a 503 redis_unavailable,
    which OpenAI's SDKs retry (three requests for one call) though asking again cannot mend it.
    Now a 500 `key_of_another_type` with `x-should-retry: false`, as a job's keys or a lane's
    stream of another type are; once the key is deleted the same calls are served. A private
    Redis and gateway: the module's drive batches that write the indexes."""
    with private_gateway(tmp_path, *gateway_flags("nobody-serves"), max_retries=2) as (admin, gateway, sdk):
        file_id = upload(sdk, [chat_line("a", "x")])
        admin.set(KEYS.files(), "an operator's mistake")
        admin.set(KEYS.batches(), "an operator's mistake")
        calls = {
            "GET '/v1/files'": sdk.files.list,
            "POST '/v1/files'": lambda: upload(sdk, [chat_line("b", "y")]),
            "GET '/v1/batches'": sdk.batches.list,
            "POST '/v1/batches'": lambda: sdk.batches.create(
                input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
            ),
        }
        for call in calls.values():
            with pytest.raises(openai.InternalServerError) as refused:
                call()
            assert refused.value.response.headers["x-should-retry"] == "false"
            assert refused.value.code == "key_of_another_type", refused.value.body
        assert eventually(lambda: "POST '/v1/batches' -> 500" in gateway.log(), timeout=10), gateway.log()
        for request in calls:
            assert len(re.findall(rf"{re.escape(request)} -> 500", gateway.log())) == 1, gateway.log()
        # The index made anew lists what is written from then on; the file it no longer names
        # is there all the same.
        admin.delete(KEYS.files(), KEYS.batches())
        assert sdk.files.retrieve(file_id).id == file_id
        uploaded = upload(sdk, [chat_line("c", "z")])
        assert [f.id for f in sdk.files.list()] == [uploaded]
        batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        assert [b.id for b in sdk.batches.list()] == [batch.id]


def test_an_upload_that_redis_refuses_part_way_leaves_none_of_its_text(tmp_path):
    """An upload is written a piece at a time, its hash last. Redis refusing a piece (maxmemory
    reached) was answered 503 redis_unavailable, which the SDKs retry, with the pieces written
    before it left under an id no call can name (no hash: never listed, GET and DELETE a 404) for
    batch_ttl_s, 7 days: each try a copy more of the memory that Redis lacked. Now the upload that
    failed deletes its text (DEL is served past maxmemory). A private Redis, whose memory the test
    may fill."""
    line = chat_line("l", "x" * 4000)
    lines = [{**line, "custom_id": f"l{i}"} for i in range(450)]  # about 7 pieces
    with private_gateway(tmp_path, *gateway_flags("nobody-serves")) as (admin, gateway, sdk):
        used = admin.info("memory")["used_memory"]
        admin.config_set("maxmemory", used + 3 * PIECE_CHARS)  # noeviction: a few pieces fit, not the file
        try:
            with pytest.raises(openai.APIStatusError) as refused:
                upload(sdk, lines)
            assert (refused.value.status_code, refused.value.code) == (503, "redis_unavailable"), refused.value.body
        finally:
            admin.config_set("maxmemory", 0)
        assert admin.keys(f"{KEYS.prefix}:file:*") == []
        file_id = upload(sdk, lines)  # with room, the same upload is stored whole
        assert len(sdk.files.content(file_id).text.splitlines()) == len(lines)


def test_a_failing_look_for_batches_is_logged_once_while_it_lasts(tmp_path):
    """A gateway looks for batches to drive every batch_poll_s; each look that failed logged a
    warning, a line a second for as long as the index of unfinished batches held another type (or
    Redis was away). Now one line when it starts, one when it ends, one if it starts again."""
    with EmbeddedRedis(port=free_port()) as server:
        admin = redis.Redis.from_url(server.url, decode_responses=True)
        admin.set(KEYS.batches_unfinished(), "an operator's mistake")
        gateway = GatewayProcess(server.url, tmp_path, *gateway_flags("nobody-serves"), "--batch-poll-s", "0.02")
        warning = "looking for batches to drive: ResponseError: WRONGTYPE"
        again = "looking for batches to drive: Redis answers again"
        try:
            gateway.start()
            assert eventually(lambda: warning in gateway.log(), timeout=10), gateway.log()
            time.sleep(50 * 0.02)
            assert gateway.log().count(warning) == 1, gateway.log()
            admin.delete(KEYS.batches_unfinished())
            assert eventually(lambda: again in gateway.log(), timeout=10), gateway.log()
            admin.set(KEYS.batches_unfinished(), "an operator's mistake")
            assert eventually(lambda: gateway.log().count(warning) == 2, timeout=10), gateway.log()
            time.sleep(50 * 0.02)
            assert (gateway.log().count(warning), gateway.log().count(again)) == (2, 1), gateway.log()
        finally:
            gateway.stop()
            admin.close()


def test_an_index_of_another_type_refuses_a_files_or_batchs_write_before_anything_is_written(tmp_path):
    """A file's upload and delete and a batch's create each write a hash and the indexes it is in
    (every owner's, its owner's, the unfinished batches) in one pipeline, which ran its other
    commands around the one an index of another type failed: DELETE /v1/files/{id} answered 500
    key_of_another_type with the file deleted, an upload and a create answered it with their file
    or batch stored, and the batch driven (its lines enqueued) though its creator was told it
    failed and never learned its id. Now each index is read first, and such a write is refused
    with nothing written or deleted. A keyed gateway, so that its files and batches have an owner
    and an owner's index; a private Redis, whose every key the test can see."""
    key = uuid.uuid4().hex + uuid.uuid4().hex
    flags = (*gateway_flags("nobody-serves"), "--api-keys", json.dumps([key]))
    with private_gateway(tmp_path, *flags, api_key=key) as (admin, gateway, sdk):
        file_id = upload(sdk, [chat_line("a", "x")])
        (own_files,) = admin.keys(f"{KEYS.files()}:of:*")
        owner = own_files.removeprefix(f"{KEYS.files()}:of:")
        indexes = (KEYS.files(), own_files, KEYS.batches(), KEYS.batches_of(owner), KEYS.batches_unfinished())

        def stored() -> tuple:
            """Every file's and batch's keys, and what each index that is one names."""
            named = [admin.zrange(i, 0, -1) if admin.type(i) == "zset" else None for i in indexes]
            return sorted(admin.keys(f"{KEYS.prefix}:file:*") + admin.keys(f"{KEYS.prefix}:batch:*")), named

        upload_one = lambda: upload(sdk, [chat_line("c", "z")])  # noqa: E731
        delete = lambda: sdk.files.delete(file_id)  # noqa: E731
        create = lambda: sdk.batches.create(  # noqa: E731
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        writes = {indexes[0]: (upload_one, delete), indexes[1]: (upload_one, delete)}
        writes |= {index: (create,) for index in indexes[2:]}
        for index, calls in writes.items():
            held = admin.dump(index)
            admin.delete(index)
            admin.set(index, "an operator's mistake")
            for call in calls:
                before = stored()
                with pytest.raises(openai.InternalServerError) as refused:
                    call()
                assert refused.value.code == "key_of_another_type", (index, refused.value.body)
                assert stored() == before, index
            admin.delete(index)
            if held is not None:
                admin.restore(index, 0, held)
        assert sdk.files.retrieve(file_id).id == file_id


def test_a_files_text_of_another_type_is_a_500_before_its_answer_begins(tmp_path):
    """GET /v1/files/{id}/content streams the file's text: its first read came after the 200 had
    gone out, so a text key of another type cut the answer off (an incomplete chunked body, which
    the SDK raised as a broken connection and retries) with uvicorn's traceback in the log. Now
    the first pieces are read before the answer begins: a 500 key_of_another_type, not retried."""
    with private_gateway(tmp_path, *gateway_flags("nobody-serves")) as (admin, gateway, sdk):
        file_id = upload(sdk, [chat_line("a", "x")])
        text = sdk.files.content(file_id).text
        held = admin.dump(KEYS.file_content(file_id))
        admin.delete(KEYS.file_content(file_id))
        admin.set(KEYS.file_content(file_id), "an operator's mistake")
        with pytest.raises(openai.InternalServerError) as refused:
            sdk.files.content(file_id)
        assert refused.value.code == "key_of_another_type", refused.value.body
        assert refused.value.response.headers["x-should-retry"] == "false"
        admin.delete(KEYS.file_content(file_id))
        admin.restore(KEYS.file_content(file_id), 0, held)
        assert sdk.files.content(file_id).text == text
        assert "Exception in ASGI application" not in gateway.log(), gateway.log()


def test_a_batch_whose_input_text_is_of_another_type_fails_naming_it(tmp_path):
    """A batch's input file whose text key holds another type: its validation raised WRONGTYPE,
    the driver logged 'driving stopped' with a traceback and gave the batch up, the next look took
    it again, a traceback every poll for as long as the batch lived, and it stayed `validating`.
    Now it fails as a batch whose input file is gone does, its error naming the file."""
    with private_gateway(tmp_path, *gateway_flags("nobody-serves")) as (admin, gateway, sdk):
        file_id = upload(sdk, [chat_line("a", "x")])
        admin.delete(KEYS.file_content(file_id))
        admin.set(KEYS.file_content(file_id), "an operator's mistake")
        batch = sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
        ended = wait_for(sdk, batch.id, lambda b: b.status in ENDED, timeout=30)
        assert ended.status == "failed", ended
        (error,) = ended.errors.data
        assert error.code == "invalid_input_file" and file_id in error.message, error
        assert "driving stopped" not in gateway.log(), gateway.log()


def test_a_batch_hash_of_another_type_is_left_out_of_listings_and_no_longer_driven(tmp_path):
    """A batch's hash someone made another type (a SET at its key), its id still in the indexes:
    GET /v1/batches answered 500 for every batch (the SDK's list raised), and the driver took it
    every poll, gave it up with a 'driving stopped' traceback, and took it again. Now the listing
    leaves it out and serves the others, warning once; the driver warns once and drops it from the
    unfinished batches; its own GET stays a 500 key_of_another_type, not retried."""
    bad = f"batch_{uuid.uuid4().hex}"
    flags = (*gateway_flags("nobody-serves"), "--batch-poll-s", "0.02")
    with private_gateway(tmp_path, *flags) as (admin, gateway, sdk):
        older = run_batch(sdk, [chat_line("a", "x")])
        admin.set(KEYS.batch(bad), "an operator's mistake")
        admin.zadd(KEYS.batches(), {bad: time.time()})
        admin.zadd(KEYS.batches_unfinished(), {bad: time.time()})
        newer = run_batch(sdk, [chat_line("b", "y")])
        for _ in range(3):
            assert [b.id for b in sdk.batches.list()] == [newer.id, older.id]
        assert [b.id for b in sdk.batches.list(limit=1, after=newer.id)] == [older.id]
        assert eventually(lambda: admin.zscore(KEYS.batches_unfinished(), bad) is None, timeout=10)
        time.sleep(50 * 0.02)  # fifty more looks for batches
        log = gateway.log()
        assert log.count(f"batch {bad}: its hash {KEYS.batch(bad)} holds another type") == 1, log
        assert log.count(f"batch {bad}: its hash holds another type") == 1, log
        assert "driving stopped" not in log and "Traceback" not in log, log
        with pytest.raises(openai.InternalServerError) as refused:
            sdk.batches.retrieve(bad)
        assert refused.value.code == "key_of_another_type", refused.value.body
        assert refused.value.response.headers["x-should-retry"] == "false"
        assert admin.zscore(KEYS.batches_unfinished(), older.id) is not None  # the others still driven


def test_a_file_hash_of_another_type_is_left_out_of_listings_and_the_others_are_served(tmp_path):
    """A file's hash someone made another type (a SET at its key), its id still in the index:
    GET /v1/files answered 500 for every file (the SDK's list raised), as batches' listing did
    before 721a8f2. Now the listing leaves it out and serves the others, pages and `purpose` filter
    included, warning once; its own GET stays a 500 key_of_another_type, not retried."""
    bad = f"file-{uuid.uuid4().hex}"
    with private_gateway(tmp_path, *gateway_flags("nobody-serves")) as (admin, gateway, sdk):
        older = sdk.files.create(file=("a.jsonl", io.BytesIO(b'{"a": 1}\n')), purpose="batch")
        admin.set(KEYS.file(bad), "an operator's mistake")
        admin.zadd(KEYS.files(), {bad: time.time()})
        newer = sdk.files.create(file=("b.jsonl", io.BytesIO(b'{"b": 2}\n')), purpose="batch")
        for _ in range(3):
            assert [f.id for f in sdk.files.list()] == [newer.id, older.id]
        assert [f.id for f in sdk.files.list(purpose="batch")] == [newer.id, older.id]
        first = sdk.files.list(limit=1)
        assert [f.id for f in first.data] == [newer.id] and first.has_more
        assert [f.id for f in sdk.files.list(limit=1, after=newer.id).data] == [older.id]
        assert [f.id for f in sdk.files.list(order="asc")] == [older.id, newer.id]
        log = gateway.log()
        assert log.count(f"file {bad}: its hash {KEYS.file(bad)} holds another type") == 1, log
        assert "Traceback" not in log, log
        with pytest.raises(openai.InternalServerError) as refused:
            sdk.files.retrieve(bad)
        assert refused.value.code == "key_of_another_type", refused.value.body
        assert refused.value.response.headers["x-should-retry"] == "false"
