"""Structured outputs through the queue: real redis-server, real worker processes on the tiny
preset (random weights: whatever the mask lets through), the real client.

Schemas are drawn by hypothesis (tests/structured_schemas.py); every output of every job, greedy
and sampled, streamed and not, prompt and chat, parses and validates, in a batch whose free jobs
draw exactly what they draw alone. A worker killed with kill -9 mid-generation leaves its jobs
to another, which resumes each after its recorded tokens (a fresh matcher fed those tokens) to
the very output of an uninterrupted run. What cannot compile is refused before it is enqueued,
and a raw XADD of it fails as a job while the worker serves on."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import urllib.request
import uuid

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from harness.polling import eventually
from producer_client import Client, SamplingParams
from producer_client.errors import InvalidArgument
from producer_client.keys import PROTOCOL_VERSION, Keys
from producer_client.placement import prefix_key, rendezvous_score
from producer_client.schema import JobFailed, JobRequest
from tests.structured_schemas import MAX_TOKENS, SCHEMAS
from tests.support.clients import make_client
from tests.support.jobs import runs
from tests.support.workers import WorkerProcess, start_workers

KEYS = Keys()
QUEUE = "structured"
FLAGS = ("--max-running", "16", "--max-model-len", "512")
# Tokens recorded many times over during a job, so the kill lands between checkpoints of jobs still
# running (at the default 1 s a job can end before its second checkpoint).
RECLAIM = ("--claim-idle-ms", "2000", "--reclaim-interval-s", "0.2", "--checkpoint-interval-s", "0.1")
FREE = [  # jobs without a format in the same batch: their tokens must be what they are alone
    dict(prompt="The queue's free job one", max_tokens=12, temperature=0.0, ignore_eos=True),
    dict(prompt="The queue's free job two", max_tokens=12, temperature=1.0, seed=11, ignore_eos=True),
]
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "status": {"enum": ["pending", "paid", "shipped"]},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "maxLength": 6},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "note": {"type": "string", "maxLength": 12},
    },
    "required": ["id", "status", "items", "note"],
    "additionalProperties": False,
}


def json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def reference_engine():
    """The engine in this process, on one thread as the workers are: the output of an
    uninterrupted run, token for token."""
    from worker.engine.engine import Engine

    return Engine.from_pretrained("tiny", kv_cache_mib=64, max_running=16, max_model_len=512)


def generate_alone(engine, specs: list[dict]) -> list:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prompts = [engine.tokenizer.encode(s["prompt"]) for s in specs]
        return engine.generate(
            prompts, [SamplingParams(**{k: v for k, v in s.items() if k != "prompt"}) for s in specs]
        )
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    process = WorkerProcess(redis_server.url, QUEUE, "structured-1", tmp_path_factory.mktemp("structured"), *FLAGS)
    try:
        yield start_workers([process])[0]
    finally:
        process.stop()


@pytest.fixture(scope="module")
def free_alone():
    return [out.token_ids for out in generate_alone(reference_engine(), FREE)]


def assert_valid(result, schema: dict) -> None:
    assert (result.status, result.finish_reason) == ("done", "stop"), (result.finish_reason, result.text, result.error)
    jsonschema.validate(json.loads(result.text), schema)


@pytest.mark.slow
@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(schemas=st.lists(SCHEMAS, min_size=3, max_size=3), seed=st.integers(0, 2**31))
def test_every_output_through_the_queue_validates_and_free_jobs_beside_them_are_untouched(
    redis_server,
    worker,
    free_alone,
    schemas,
    seed,
):
    with Client(redis_server.url, QUEUE) as client:
        jobs = []  # (job id, schema, streamed)
        for i, schema in enumerate(schemas):
            fmt = json_schema(schema)
            jobs.append(
                (
                    client.submit(f"Item {i} as JSON:", max_tokens=MAX_TOKENS, temperature=0.0, response_format=fmt),
                    schema,
                    False,
                )
            )
            jobs.append(
                (
                    client.submit(
                        f"Item {i} as JSON:", max_tokens=MAX_TOKENS, temperature=1.0, seed=seed + i, response_format=fmt
                    ),
                    schema,
                    False,
                )
            )
            chat = [{"role": "user", "content": f"Describe item {i} in JSON."}]
            jobs.append(
                (
                    client.submit(
                        messages=chat,
                        enable_thinking=False,
                        max_tokens=MAX_TOKENS,
                        temperature=0.8,
                        top_p=0.95,
                        seed=seed + 100 + i,
                        response_format=fmt,
                    ),
                    schema,
                    True,
                )
            )
        free = [client.submit(**spec) for spec in FREE]
        for job_id, schema, streamed in jobs:
            if streamed:
                text = "".join(delta.text for delta in client.stream(job_id, timeout=300))
                result = client.result(job_id, timeout=10)
                assert text == result.text
            else:
                result = client.result(job_id, timeout=300)
            assert_valid(result, schema)
        assert [client.result(job_id, timeout=60).token_ids for job_id in free] == free_alone


def test_a_max_tokens_cut_ends_with_length_not_an_invalid_stop(redis_server, worker):
    with Client(redis_server.url, QUEUE) as client:
        result = client.generate(
            "Order:", max_tokens=5, temperature=0.0, response_format=json_schema(ORDER), timeout=120
        )
    assert (result.finish_reason, len(result.token_ids)) == ("length", 5)
    assert result.text.startswith('{"id": "ORD')  # the grammar's way, cut short


@pytest.mark.parametrize(
    "fmt, check",
    [
        ({"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
        ({"type": "regex", "pattern": "[A-Z]{2}-[0-9]{3}"}, lambda text: len(text) == 6 and text[2] == "-"),
        ({"type": "choice", "choices": ["red", "green", "blue"]}, lambda text: text in ("red", "green", "blue")),
    ],
)
def test_json_object_regex_and_choice_through_the_queue(redis_server, worker, fmt, check):
    settle(worker)  # the previous test's compile reaches the counters before they are read
    hits, compiles = metric(worker, "mili_grammar_cache_hits_total"), metric(worker, "mili_grammar_compiles_total")
    with Client(redis_server.url, QUEUE) as client:
        for params in (dict(temperature=0.0), dict(temperature=1.0, seed=5)):
            result = client.generate("Answer:", max_tokens=MAX_TOKENS, response_format=fmt, timeout=120, **params)
            if fmt["type"] == "json_object" and result.finish_reason == "length":
                continue  # a random model may write one endless string: no bound in "any object"
            assert result.finish_reason == "stop" and check(result.text), result.text
    # The second job of the format found it compiled (the first may have too, after another test).
    settle(worker)
    assert metric(worker, "mili_grammar_cache_hits_total") >= hits + 1
    assert metric(worker, "mili_grammar_compiles_total") <= compiles + 1


def settle(worker: WorkerProcess) -> None:
    """Waits for two heartbeats: the worker copies the engine's totals into its counters just after
    writing one, so once the second is written the counters hold all the engine did before this call."""
    for _ in range(2):
        before = worker.heartbeat()["updated_at"]
        assert eventually(lambda: worker.heartbeat()["updated_at"] != before, timeout=10), worker.log()  # noqa: B023


def metric(worker: WorkerProcess, name: str) -> float:
    port = int(worker.heartbeat()["metrics_port"])
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def test_what_cannot_compile_is_refused_before_anything_is_enqueued(redis_server, redis_client, client_kind):
    queue = f"refused-{uuid.uuid4().hex[:6]}"
    bad = json_schema({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}})
    client = make_client(client_kind, redis_server.url, queue)
    try:
        with pytest.raises(InvalidArgument) as refused:
            client.submit("x", response_format=bad)
        assert refused.value.field == "response_format.json_schema.schema.properties.a.uniqueItems"
        assert "Unimplemented keys" in refused.value.message
        with pytest.raises(InvalidArgument) as refused:
            client.submit_many(
                [
                    {"prompt": "fine", "response_format": {"type": "json_object"}},
                    {"prompt": "bad", "response_format": {"type": "regex", "pattern": "(?=x)"}},
                ]
            )
        assert refused.value.field == "jobs[1].response_format.pattern"
        with pytest.raises(InvalidArgument) as refused:
            client.submit(
                messages=[{"role": "user", "content": "x"}],
                tool_choice="required",
                tools=[
                    {"type": "function", "function": {"name": "f", "parameters": {"not": {"type": "string"}}}},
                ],
            )
        assert refused.value.field == "tools.0.function.parameters.not"
        with pytest.raises(InvalidArgument) as refused:
            client.submit("x", response_format={"type": "json_object"}, stop=["}"])
        assert refused.value.field == "stop"
    finally:
        client.close()
    assert redis_client.xlen(KEYS.queue(queue)) == 0


def test_a_regex_too_large_to_follow_is_refused_before_anything_is_enqueued(redis_server, redis_client, client_kind):
    """The grammar library compiles `a{1000000}` at once, and then takes over a minute for each mask
    over Qwen3's vocabulary, while every job of the worker's batch waits: a counted repetition is a
    lexer state each. A regex is refused once its repetitions unrolled pass 2000 atoms, in a
    format, a schema's pattern or patternProperties, and a forced tool's parameters."""
    queue = f"refused-{uuid.uuid4().hex[:6]}"
    client = make_client(client_kind, redis_server.url, queue)
    big = {"type": "string", "pattern": "^(ab{100}){100}$"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": big}}}}
    refused_at = {
        "response_format.pattern": dict(response_format={"type": "regex", "pattern": "a{1000000}"}),
        "response_format.json_schema.schema.properties.a.pattern": dict(
            response_format=json_schema({"type": "object", "properties": {"a": big}})
        ),
        "response_format.json_schema.schema.patternProperties.x{3000}": dict(
            response_format=json_schema({"type": "object", "patternProperties": {"x{3000}": {}}})
        ),
        "tools.0.function.parameters.properties.a.pattern": dict(
            messages=[{"role": "user", "content": "x"}], tool_choice="required", tools=[tool]
        ),
    }
    try:
        for field, request in refused_at.items():
            with pytest.raises(InvalidArgument) as refused:
                client.submit(**({"prompt": "x"} if "messages" not in request else {}), **request)
            assert refused.value.field == field
            assert "over 2000" in refused.value.message
        assert redis_client.xlen(KEYS.queue(queue)) == 0
        # What a format usually counts is far below: a UUID's pattern is 36 atoms, and the bound itself passes.
        uuid_pattern = "[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
        for pattern in (uuid_pattern, "(a{10}b){180}", "x{2000}", r"\{1000000\}"):
            job = client.submit("x", response_format={"type": "regex", "pattern": pattern})
            client.cancel(job)
    finally:
        client.close()


def test_a_raw_xadd_of_a_regex_too_large_to_follow_fails_its_job_at_once_and_the_worker_serves_on(
    redis_server, redis_client, worker
):
    """A producer's raw XADD skips the client's check: the worker refuses the regex at intake, where
    its masks held every job of its batch for minutes (a free job behind it waited 21 s at first)."""
    body = {"prompt": "x", "params": {"max_tokens": 4, "response_format": {"type": "regex", "pattern": "a{1000000}"}}}
    job_id = f"raw-{uuid.uuid4().hex[:8]}"
    redis_client.xadd(KEYS.queue(QUEUE), {"id": job_id, "v": str(PROTOCOL_VERSION), "body": json.dumps(body)})
    with Client(redis_server.url, QUEUE) as client:
        with pytest.raises(JobFailed) as failed:
            client.wait(job_id, timeout=30)
        assert failed.value.code == "invalid_argument" and failed.value.message.startswith("response_format.pattern")
        assert client.generate("ok", max_tokens=2, timeout=30).status == "done"


def test_a_raw_xadd_of_an_uncompilable_schema_fails_its_job_and_the_worker_serves_on(
    redis_server, redis_client, worker
):
    body = {"prompt": "x", "params": {"response_format": json_schema({"type": "integer", "minimum": 5, "maximum": 1})}}
    job_id = f"raw-{uuid.uuid4().hex[:8]}"
    redis_client.xadd(KEYS.queue(QUEUE), {"id": job_id, "v": str(PROTOCOL_VERSION), "body": json.dumps(body)})
    with Client(redis_server.url, QUEUE) as client:
        with pytest.raises(JobFailed) as failed:
            client.wait(job_id, timeout=120)  # no CREATE made its hash: wait on its done stream
        assert failed.value.code == "invalid_argument" and failed.value.message.startswith("response_format")
        assert client.generate("ok", max_tokens=2, timeout=120).status == "done"


@pytest.mark.slow
def test_kill_9_mid_generation_resumes_each_constrained_job_to_the_uninterrupted_output(
    redis_server, redis_client, tmp_path
):
    queue = f"structured-kill-{uuid.uuid4().hex[:6]}"
    names = [f"{queue}-{n}" for n in ("victim", "survivor")]
    specs = [
        dict(
            prompt=text,
            max_tokens=MAX_TOKENS,
            response_format=json_schema(ORDER),
            **(dict(temperature=0.0) if i % 2 else dict(temperature=1.0, seed=i)),
        )
        for i, text in enumerate(orders_placed_on(*names, each=3))
    ]
    want = generate_alone(reference_engine(), specs)
    victim, survivor = start_workers(
        [WorkerProcess(redis_server.url, queue, name, tmp_path, *FLAGS, *RECLAIM) for name in names]
    )
    try:
        with Client(redis_server.url, queue) as client:
            ids = [client.submit(**spec) for spec in specs]

            def victim_generating() -> bool:
                jobs = [redis_client.hmget(KEYS.job(j), "worker", "status", "tokens") for j in ids]
                return sum(w == victim.name and s == "running" and int(t or 0) >= 6 for w, s, t in jobs) >= 2

            assert eventually(victim_generating, timeout=180), victim.log()
            victim.process.kill()
            victim.process.wait()
            results = [client.result(job_id, timeout=300) for job_id in ids]
        resumed = 0
        for job_id, result, expected in zip(ids, results, want):
            assert_valid(result, ORDER)
            assert result.token_ids == expected.token_ids
            job_runs = runs(redis_client, job_id)
            if len(job_runs) > 1 and job_runs[0][1]:
                resumed += 1
                assert job_runs[1][0]["resumed_tokens"] == len(job_runs[0][1])  # nothing recorded is generated again
        assert resumed >= 2, [runs(redis_client, j) for j in ids]
    finally:
        for w in (victim, survivor):
            w.stop()


def orders_placed_on(victim: str, survivor: str, each: int) -> list[str]:
    """`each` prompts that cache-aware placement puts on the victim, then `each` on the survivor
    (the first in their prefix keys' rendezvous order): the kill finds the victim running jobs
    whatever names the run drew (prompts chosen blindly left it one of six, 1 run in 9)."""
    chosen: dict[str, list[str]] = {victim: [], survivor: []}
    for i in itertools.count():
        text = f"Order {i}:"
        key = prefix_key(JobRequest.model_validate({"prompt": text}))
        first = max(chosen, key=lambda name: rendezvous_score(key, name))
        if len(chosen[first]) < each:
            chosen[first].append(text)
        if all(len(texts) == each for texts in chosen.values()):
            return chosen[victim] + chosen[survivor]


def mili(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "cli", "--redis", redis_url, "--queue", QUEUE, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_cli_submits_each_kind_of_format_and_refuses_what_cannot_compile(redis_server, worker, tmp_path):
    schema_file = tmp_path / "order.json"
    schema_file.write_text(json.dumps(ORDER))
    url = redis_server.url
    streamed = mili(
        url,
        "submit",
        "Order:",
        "--max-tokens",
        str(MAX_TOKENS),
        "--temperature",
        "0",
        "--json-schema",
        f"@{schema_file}",
        "--stream",
    )
    assert streamed.returncode == 0 and "done (stop)" in streamed.stderr, streamed.stderr
    jsonschema.validate(json.loads(streamed.stdout), ORDER)
    for flags, valid in (
        (["--json"], lambda text: text.startswith("{")),
        (["--regex", "[0-9]{4}"], lambda text: len(text) == 4 and text.isdigit()),
        (["--choice", "left", "--choice", "right"], lambda text: text in ("left", "right")),
    ):
        submitted = mili(url, "submit", "Pick:", "--max-tokens", "40", "--temperature", "0", *flags)
        assert submitted.returncode == 0, submitted.stderr
        result = json.loads(mili(url, "result", submitted.stdout.strip(), "--timeout", "60").stdout)
        assert valid(result["text"]), result
    refused = mili(url, "submit", "x", "--json-schema", json.dumps({"type": "array", "uniqueItems": True}))
    assert refused.returncode == 1 and refused.stderr.startswith(
        "error: invalid_argument: response_format.json_schema.schema.uniqueItems: the grammar library refuses it:"
    ), refused.stderr
    not_json = mili(url, "submit", "x", "--json-schema", "{not json")
    assert not_json.returncode == 1 and not_json.stderr.startswith(
        "error: invalid_argument: json_schema: not JSON (give the schema's JSON text, or @FILE): "
    )
    both = mili(url, "submit", "x", "--json", "--regex", "a")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
