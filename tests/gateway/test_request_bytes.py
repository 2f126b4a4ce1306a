"""The bytes one request may put in Redis (the gateway's max_request_jobs_bytes): each of a
request's n choices is a job that holds the whole prompt, so that one request of n=128 choices of
a 0.9 MiB prompt enqueued 115 MB, and an API key could fill Redis to its maxmemory for every
tenant. A request over the bound is refused before anything is enqueued; one at the bound is
served. Through the official `openai` SDK, against a real gateway, an echo worker and a
redis-server of this module's own (every gateway on a Redis drives the batches it finds there,
and the session's gateway has the default bound)."""

from __future__ import annotations

import io
import json
import uuid

import openai
import pytest

from gateway.settings import GatewaySettings
from harness.polling import eventually
from openai_format.job_specs import JobSpec, chat_jobs, check_jobs, completion_jobs, parse_body
from openai_format.requests import ChatCompletionRequest, CompletionRequest
from producer_client.errors import BodyTooLarge
from producer_client.new_job import NewJob
from tests.support.gateways import GatewayProcess
from tests.support.jobs import entries_added
from tests.support.workers import echo_workers
from worker.embedded_redis import EmbeddedRedis, free_port

MODEL = "bytes-echo"
# The least the setting takes (a job's own bound, MAX_BODY_BYTES): n=128 choices of 8 KiB reach it.
BOUND = 1 << 20
N = 128
JOB_BYTES = BOUND // N  # a job of this size, N times, is the bound exactly


@pytest.fixture(scope="module")
def redis_server():
    with EmbeddedRedis(port=free_port()) as server:
        yield server


@pytest.fixture(scope="module")
def queue():
    return f"bytes-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def gateway(redis_server, queue, tmp_path_factory):
    """An echo worker that takes prompts of JOB_BYTES, and a gateway bound to BOUND. The bound is
    set by its variable, not a flag: a gateway without the setting (19c2fdf) starts all the same,
    and serves what this one refuses."""
    log_dir = tmp_path_factory.mktemp("request-bytes")
    with echo_workers(redis_server.url, queue, log_dir, "--max-model-len", str(4 * JOB_BYTES), count=1):
        process = GatewayProcess(
            redis_server.url,
            log_dir,
            "--models",
            json.dumps({MODEL: queue}),
            "--batch-poll-s",
            "0.1",
            env={"MILI_MAX_REQUEST_JOBS_BYTES": str(BOUND)},
        )
        try:
            yield process.start()
        finally:
            process.stop()


def chat_body(job_bytes: int, timeout_s: float | None = GatewaySettings().job_timeout_s, **more) -> dict:
    """A chat whose every job's body takes `job_bytes` as the gateway checks it: with its
    job_timeout_s in it, or for a batch's line without a deadline (its jobs' deadline, the batch's
    window, is known at their submit: their bodies hold a few bytes more than the check counted)."""

    def body(content: str) -> dict:
        return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **more}

    def size(content: str) -> int:
        spec = chat_jobs(parse_body(ChatCompletionRequest, json.dumps(body(content))))[0]
        return len(spec.check(timeout_s).body.encode())

    content = "x" * (job_bytes - (size("x") - 1))
    assert size(content) == job_bytes
    return body(content)


def used_memory(redis_client) -> int:
    return redis_client.info("memory")["used_memory"]


def settled_memory(redis_client) -> int:
    """Redis's used memory once the module's earlier work has settled: the same figure in three
    reads a quarter second apart. An earlier test's jobs are acknowledged and their done streams
    dropped after its answer (the worker's next read, the forget a few seconds on), and Redis
    resizes the big query buffers of the earlier requests' pipelines in its cron; the first test
    of the module reads while the worker and the gateway are still starting. On a slow machine
    those ran into the readings below (87 KB more after a refused request, in CI; 34-49 KB here
    where this test runs first, 24.7 KB in every run from a settled reading)."""
    readings: list[int] = []

    def steady() -> bool:
        readings.append(used_memory(redis_client))
        return len(readings) > 2 and readings[-1] == readings[-2] == readings[-3]

    assert eventually(steady, 30, interval=0.25), readings[-8:]
    return readings[-1]


def test_a_chat_whose_choices_pass_the_bound_is_refused_and_enqueues_nothing(sdk, redis_client, queue):
    """n=128 choices of a job one byte over BOUND / 128: a 400 in OpenAI's shape naming `n`, and
    Redis holds no job of it (the queue's entries ever added, and its memory, as before)."""
    added, memory = entries_added(redis_client, queue), settled_memory(redis_client)
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.chat.completions.create(**chat_body(JOB_BYTES + 1), n=N)
    error = refused.value.body
    assert (refused.value.status_code, error["type"], error["code"], error["param"]) == (
        400,
        "invalid_request_error",
        "body_too_large",
        "n",
    ), error
    assert f"{N} jobs" in error["message"] and str(BOUND) in error["message"], error
    assert "x-mili-job-ids" not in refused.value.response.headers
    assert entries_added(redis_client, queue) == added
    # The jobs would have taken BOUND bytes and more; what a request leaves (a connection's
    # buffers, the registry's reads) is a few KiB.
    assert used_memory(redis_client) - memory < BOUND // 16


def test_a_chat_whose_choices_take_the_bound_exactly_is_served(sdk, redis_client, queue):
    added = entries_added(redis_client, queue)
    answer = sdk.chat.completions.create(**chat_body(JOB_BYTES), n=N)
    assert [choice.index for choice in answer.choices] == list(range(N))
    assert entries_added(redis_client, queue) - added == N


def test_a_batch_line_over_the_bound_is_answered_400_and_enqueues_nothing(sdk, redis_client, queue):
    """Each line of a batch is one request, its jobs bound as an HTTP request's: the line over the
    bound is answered in the error file with the HTTP API's 400; the line at it runs."""

    def line(custom_id: str, job_bytes: int) -> str:
        body = chat_body(job_bytes, timeout_s=None, n=N)
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})

    text = "".join(f"{line(custom_id, size)}\n" for custom_id, size in (("over", JOB_BYTES + 1), ("at", JOB_BYTES)))
    added = entries_added(redis_client, queue)
    file_id = sdk.files.create(file=("input.jsonl", io.BytesIO(text.encode())), purpose="batch").id
    created = sdk.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h")
    batch = eventually(
        lambda: (b := sdk.batches.retrieve(created.id)).status in ("completed", "failed") and b, 120, interval=0.1
    )
    assert batch and batch.status == "completed", batch
    done = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert [(a["custom_id"], len(a["response"]["body"]["choices"])) for a in done] == [("at", N)]
    failed = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert [(a["custom_id"], a["response"]["status_code"]) for a in failed] == [("over", 400)], failed
    error = failed[0]["response"]["body"]["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "body_too_large", "n"), error
    assert entries_added(redis_client, queue) - added == N  # the line at the bound's jobs alone


# -- the check itself, without Redis ------------------------------------------------------------


def counted_checks(monkeypatch) -> list[JobSpec]:
    checked: list[JobSpec] = []
    check = JobSpec.check

    def counted(spec: JobSpec, *args) -> NewJob:
        checked.append(spec)
        return check(spec, *args)

    monkeypatch.setattr(JobSpec, "check", counted)
    return checked


def test_a_seeded_request_over_the_bound_is_refused_from_its_first_job(monkeypatch):
    """With a seed each choice is another job (seed + i), each checked; over the bound the request
    is refused from the first's size times n, before the 127 others are built (a chat of 33,000
    messages takes 130 ms to build)."""
    body = chat_body(JOB_BYTES + 1, n=N, seed=7)
    specs = chat_jobs(parse_body(ChatCompletionRequest, json.dumps(body)))
    checked = counted_checks(monkeypatch)
    with pytest.raises(BodyTooLarge) as refused:
        check_jobs(specs, GatewaySettings().job_timeout_s, False, BOUND)
    assert (refused.value.field, len(checked)) == ("n", 1)


@pytest.mark.parametrize(("prompts", "n", "param"), [(2, 64, "n"), (128, 1, "prompt")])
def test_a_completions_prompts_count_together(prompts, n, param):
    """A completion's prompts times n: each prompt's choices count, and the error names what to
    lower, n, or the prompt where each prompt has one choice."""
    prompt = "x" * (JOB_BYTES + 1 - len('{"prompt":"","params":{"max_tokens":16}}'))
    body = {"model": MODEL, "prompt": [prompt] * prompts, "n": n}
    specs = completion_jobs(parse_body(CompletionRequest, json.dumps(body)))
    assert len(specs[0].check(None).body) == JOB_BYTES + 1
    with pytest.raises(BodyTooLarge) as refused:
        check_jobs(specs, None, False, BOUND)
    assert refused.value.field == param
    assert check_jobs(specs, None, False, BOUND + prompts * n).tokens == sum(spec.check(None).cost for spec in specs)


def test_the_setting_is_not_below_a_single_jobs_bound():
    """A request of one job is not checked against the bound (Gateway.check): the job's own bound
    (MAX_BODY_BYTES) is within it."""
    with pytest.raises(ValueError, match="max_request_jobs_bytes"):
        GatewaySettings(max_request_jobs_bytes=BOUND - 1)
