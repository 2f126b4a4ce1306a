"""LoRA adapters end to end: the session's tiny worker serves two (conftest.py). Over HTTP a
request's `model` names the adapter, as vLLM takes it (the official openai SDK), and /v1/models
lists adapters with their base model as `parent`; the client library takes `adapter=`; what each
returns is what the offline engine generates with that adapter. An adapter no live worker serves
is refused before anything is enqueued (a 404 model_not_found, UnknownAdapter), and a job that
reaches a worker that does not serve its adapter fails with that code."""

import json
import subprocess
import sys
import uuid

import httpx
import openai
import pytest

from gateway.registry import Route, RouteTable
from harness.polling import eventually
from producer_client import Client, JobFailed, WorkerInfo
from producer_client.errors import UnknownAdapter
from producer_client.keys import PROTOCOL_VERSION, Keys
from tests.gateway.support import LORA_ADAPTERS, TINY_QUEUE

PROMPT = [9707, 1879, 11, 1246, 525, 498]  # token ids, so that both sides see the same prompt


def entries_naming(redis_client, adapter: str) -> int:
    """Queue entries, in any stream (the shared ones and the workers' own), whose job names
    `adapter`: a count of what was enqueued, which a stream's length is not (a finished job's entry
    is deleted)."""
    needle = json.dumps(adapter)
    streams = redis_client.scan_iter(_type="stream")
    return sum(
        needle in value for key in streams for _, fields in redis_client.xrange(key) for value in fields.values()
    )


@pytest.fixture(scope="module")
def offline(lora_adapters):
    """What the engine generates greedily for PROMPT with each adapter, and with none."""
    from producer_client.schema import SamplingParams
    from worker.engine import Engine

    names = [None, *LORA_ADAPTERS]
    with Engine.from_pretrained("tiny", lora_modules=lora_adapters, max_lora_rank=16, num_pages=64) as engine:
        outs = engine.generate([PROMPT] * len(names), SamplingParams(temperature=0, max_tokens=8), adapters=names)
    return {name: out.text for name, out in zip(names, outs)}


def test_a_request_whose_model_names_an_adapter_runs_on_it(sdk, offline):
    texts = {
        name: sdk.completions.create(model=name or "tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
        for name in offline
    }
    assert texts == offline
    assert len(set(texts.values())) == len(texts)  # each adapter changes what the model says


def test_generate_runs_on_the_adapter_its_model_names(gateway, sdk):
    """The seed's /generate routes `model` as the OpenAI routes do: an adapter's name runs on it."""

    def generate(model: str) -> str:
        body = {"prompt": "Redis streams are", "max_tokens": 8, "temperature": 0, "model": model}
        reply = httpx.post(f"{gateway.url}/generate", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["generated_text"]

    def completion(model: str) -> str:
        return (
            sdk.completions.create(model=model, prompt="Redis streams are", max_tokens=8, temperature=0).choices[0].text
        )

    assert generate("tiny-sql") == completion("tiny-sql") != generate("tiny")
    missing = httpx.post(f"{gateway.url}/generate", json={"prompt": "x", "model": "tiny-nope"}, timeout=30)
    assert (missing.status_code, missing.json()["error"]["code"]) == (404, "model_not_found")


def test_a_batch_line_whose_model_names_an_adapter_runs_on_it(sdk, offline):
    """The session's gateway drives the batch; each line's model routes it, adapters included."""
    names = {"base": "tiny", **{f"on-{name}": name for name in LORA_ADAPTERS}, "nope": "tiny-nope"}
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        }
        for custom_id, model in names.items()
    ]
    upload = sdk.files.create(file=("lines.jsonl", "\n".join(map(json.dumps, lines)).encode()), purpose="batch")
    created = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    batch = eventually(lambda: (b := sdk.batches.retrieve(created.id)).status in ("completed", "failed") and b, 120)
    assert batch and batch.status == "completed", batch
    done = [json.loads(line) for line in sdk.files.content(batch.output_file_id).text.splitlines()]
    texts = {line["custom_id"]: line["response"]["body"]["choices"][0]["text"] for line in done}
    assert texts == {"base": offline[None], **{f"on-{name}": offline[name] for name in LORA_ADAPTERS}}
    (refused,) = [json.loads(line) for line in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert (refused["custom_id"], refused["response"]["status_code"]) == ("nope", 404)
    assert refused["response"]["body"]["error"]["code"] == "model_not_found"


def test_models_lists_each_adapter_with_its_base_model_as_parent(gateway, sdk):
    listed = {m["id"]: m for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]}
    assert {name: listed[name]["parent"] for name in LORA_ADAPTERS} == dict.fromkeys(LORA_ADAPTERS, "tiny")
    assert listed["tiny"]["parent"] is None
    card = httpx.get(f"{gateway.url}/v1/models/tiny-sql").json()
    assert (card["id"], card["object"], card["owned_by"], card["parent"]) == ("tiny-sql", "model", "mili", "tiny")
    assert sdk.models.retrieve("tiny-chat").id == "tiny-chat"


def test_an_adapter_no_worker_serves_is_a_404_before_anything_is_enqueued(sdk, redis_client):
    with pytest.raises(openai.NotFoundError) as e:
        sdk.chat.completions.create(model="tiny-nope", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert e.value.code == "model_not_found"
    assert entries_naming(redis_client, "tiny-nope") == 0


def test_the_client_runs_a_job_on_an_adapter_and_refuses_an_unknown_one(
    redis_server, gateway_workers, offline, redis_client
):
    with Client(redis_server.url, TINY_QUEUE) as client:
        result = client.generate(input_ids=PROMPT, adapter="tiny-sql", max_tokens=8, temperature=0, timeout=120)
        assert result.text == offline["tiny-sql"]
        beat = Keys().worker(result.worker)  # what it serves, and now holds
        assert redis_client.hget(beat, "adapters") == ",".join(sorted(LORA_ADAPTERS))
        assert eventually(lambda: "tiny-sql" in redis_client.hget(beat, "adapters_held").split(","))
        ids = client.submit_many(
            [{"input_ids": PROMPT, "adapter": name, "max_tokens": 8, "temperature": 0} for name in LORA_ADAPTERS]
        )
        assert [client.result(i, timeout=120).text for i in ids] == [offline[n] for n in LORA_ADAPTERS]
        request_ids = [f"nope-{uuid.uuid4().hex}" for _ in range(3)]
        with pytest.raises(UnknownAdapter) as e:
            client.submit(input_ids=PROMPT, adapter="tiny-nope", request_id=request_ids[0])
        assert e.value.code == "model_not_found" and "tiny-nope" in e.value.message
        with pytest.raises(UnknownAdapter):
            client.submit_many(
                [
                    {"input_ids": PROMPT, "request_id": request_ids[1]},
                    {"input_ids": PROMPT, "adapter": "tiny-nope", "request_id": request_ids[2]},
                ]
            )
        assert [redis_client.exists(Keys().job(i)) for i in request_ids] == [0, 0, 0]  # no job was created
        assert entries_naming(redis_client, "tiny-nope") == 0


def test_a_job_whose_adapter_only_the_worker_finds_unknown_fails_with_the_code(
    redis_server, gateway_workers, redis_client
):
    job_id = f"raw-{uuid.uuid4().hex}"
    body = json.dumps({"input_ids": PROMPT, "adapter": "tiny-nope", "params": {"max_tokens": 2}})
    redis_client.xadd(
        Keys().queue(TINY_QUEUE), {"id": job_id, "v": str(PROTOCOL_VERSION), "body": body}
    )  # past the client's check
    assert eventually(lambda: redis_client.exists(Keys().job(job_id)), timeout=60)
    with Client(redis_server.url, TINY_QUEUE) as client:
        with pytest.raises(JobFailed) as e:
            client.result(job_id, timeout=60)
        assert e.value.code == "model_not_found" and "tiny-nope" in e.value.message
        assert client.generate(input_ids=PROMPT, max_tokens=2, timeout=60).status == "done"


def worker_info(name: str, queue: str, model: str, adapters: str) -> WorkerInfo:
    beat = {"name": name, "queue": queue, "model": model, "device": "cpu", "state": "serving"}
    return WorkerInfo.model_validate(
        {**beat, "running": 0, "free_slots": 1, "free_pages": 1, "started_at": 1.0, "adapters": adapters}
    )


def test_routes_send_an_adapter_to_the_queue_most_of_its_workers_serve_it_on_and_a_model_name_wins():
    workers = [
        worker_info("w1", "q1", "qwen", "sql,chat"),
        worker_info("w2", "q2", "qwen", "sql"),
        worker_info("w3", "q2", "qwen", "sql,qwen-big"),
        worker_info("w4", "q3", "qwen-big", ""),
    ]
    table = RouteTable.build(workers, {"pinned": "q9"}, pinned_since=5.0)
    assert table.route("sql") == Route("q2", "sql")
    assert table.route("chat") == Route("q1", "chat")
    assert table.route("qwen-big") == Route("q3", None)  # a model's name is the model, not the adapter
    assert table.route("pinned") == Route("q9", None) and table.route("nope") is None
    listed = {c.id: (c.parent, c.created) for c in table.cards}
    # A pinned name is listed while its queue has no worker (requests to it wait there), not as live.
    assert listed == {
        "qwen": (None, 1),
        "qwen-big": (None, 1),
        "sql": ("qwen", 1),
        "chat": ("qwen", 1),
        "pinned": (None, 5),
    }
    assert table.live == {"qwen", "qwen-big", "sql", "chat"}


def test_the_cli_submits_on_an_adapter_and_refuses_an_unknown_one(redis_server, gateway_workers):
    def mili(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "cli", "--redis", redis_server.url, "--queue", TINY_QUEUE, *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)

    outputs = {}
    for adapter in ("tiny-sql", None):
        flags = ["--adapter", adapter] if adapter else []
        submitted = mili("submit", "Name a prime number.", "--max-tokens", "6", "--temperature", "0", *flags)
        assert submitted.returncode == 0, submitted.stderr
        done = mili("result", submitted.stdout.strip(), "--timeout", "60")
        assert done.returncode == 0, (submitted.stdout, done.stderr)
        result = json.loads(done.stdout)
        assert result["status"] == "done"
        outputs[adapter] = result["token_ids"]
    assert outputs["tiny-sql"] != outputs[None]
    unknown = mili("submit", "x", "--adapter", "tiny-nope")
    assert (unknown.returncode, unknown.stderr.strip()) == (
        1,
        f"error: model_not_found: no LoRA adapter named 'tiny-nope' is served by the live workers of queue '{TINY_QUEUE}'",
    )
