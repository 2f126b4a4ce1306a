"""1,000 generated bad stream entries, written with raw XADD, interleaved with 50 good jobs: every
bad one ends failed with the code its fault calls for, every good one done, and the worker (one
process, the echo engine: the model plays no part in reading entries) stays up throughout."""

from __future__ import annotations

import json
import random
import uuid

import pytest
import redis

from harness.polling import eventually
from producer_client import JobFailed
from producer_client.keys import PROTOCOL_VERSION, Keys
from tests.support.clients import make_client
from tests.support.jobs import queue_depth
from tests.support.workers import WorkerProcess, start_workers

KEYS = Keys()
MAX_BODY_BYTES = 2048
MAX_MODEL_LEN = 64  # the echo engine's context here: longer prompts fail with prompt_too_long
GOOD_EVERY = 21  # one good job among every 21 entries: 50 good, 1,000 bad


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def bad_entries(rng: random.Random):
    """Endless (entry fields, the error code its job must end with). A missing or unusable `id`
    is given as None: the job is then reported under `entry-<entry id>`."""
    ok = body(prompt="fine", params={"max_tokens": 4})
    wrong_types = [
        {"prompt": 5},
        {"prompt": ["a"]},
        {"prompt": None},
        {"messages": "hi"},
        {"messages": [{"role": "user"}]},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"input_ids": ["a"]},
        {"input_ids": 7},
        {"prompt": "a", "params": {"max_tokens": "5"}},
        {"prompt": "a", "params": {"max_tokens": 2.5}},
        {"prompt": "a", "params": {"temperature": "hot"}},
        {"prompt": "a", "params": {"stop": "x"}},
        {"prompt": "a", "params": {"ignore_eos": "yes"}},
        {"prompt": "a", "params": []},
        {"prompt": "a", "priority": 1.5},
        {"prompt": "a", "params": {"max_tokens": True}},
        {"prompt": "a", "timeout_s": "soon"},
    ]
    out_of_range = [
        {"max_tokens": 0},
        {"max_tokens": -1},
        {"max_tokens": 10**9},
        {"temperature": -1},
        {"temperature": 101},
        {"top_p": 0},
        {"top_p": 2},
        {"top_k": -1},
        {"min_p": 2},
        {"seed": -1},
        {"seed": 2**64},
        {"logprobs": 99},
        {"repetition_penalty": 0},
        {"presence_penalty": 3},
        {"frequency_penalty": -9},
        {"min_tokens": 9, "max_tokens": 8},
        {"stop": ["x"] * 17},
        {"stop": ["y" * 257]},
        {"stop": [""]},
        {"stop_token_ids": [-3]},
    ]
    unknown_fields = [
        {"prompt": "a", "model": "x"},
        {"prompt": "a", "params": {"beam_width": 4}},
        {"prompt": "a", "n": 2},
    ]
    exactly_one = [
        {},
        {"prompt": "a", "input_ids": [1]},
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
    ]
    malformed = [
        b"",
        b"{",
        b"not json",
        b"[1, 2]",
        b"42",
        b'"a string"',
        b"null",
        b"true",
        b'{"prompt": "a"',
        b"\xff\xfe\x00",
        b'{"prompt": "\\ud800"}',
        b"[" * 900 + b"]" * 900,
        b'{"prompt": "caf\xc3"}',
    ]
    makers = [
        lambda: ({"v": str(PROTOCOL_VERSION), "body": ok}, "invalid_body", None),  # no id
        lambda: (
            {
                "id": rng.choice(["", "a b", "{x}", "x" * 129, "-lead", "caf\xe9".encode("latin-1")]),
                "v": str(PROTOCOL_VERSION),
                "body": ok,
            },
            "invalid_body",
            None,
        ),
        lambda: (
            {"v": rng.choice(["1", "3", "0", "abc", "", "1.0", b"\xff"]), "body": ok},
            "unsupported_version",
            "id",
        ),
        lambda: ({"body": ok}, "unsupported_version", "id"),  # no version
        lambda: (
            {"v": str(PROTOCOL_VERSION), "body": ok, rng.choice(["priority", "x", "bodyy"]): "1"},
            "invalid_body",
            "id",
        ),
        lambda: ({"v": str(PROTOCOL_VERSION)}, "invalid_body", "id"),  # no body
        lambda: ({"v": str(PROTOCOL_VERSION), "body": rng.choice(malformed)}, "invalid_body", "id"),
        lambda: ({"v": str(PROTOCOL_VERSION), "body": body(prompt="x" * MAX_BODY_BYTES)}, "body_too_large", "id"),
        lambda: ({"v": str(PROTOCOL_VERSION), "body": body(**rng.choice(wrong_types))}, "invalid_argument", "id"),
        lambda: (
            {"v": str(PROTOCOL_VERSION), "body": b'{"prompt": "a", "params": {"temperature": NaN}}'},
            "invalid_argument",
            "id",
        ),
        lambda: (
            {"v": str(PROTOCOL_VERSION), "body": body(prompt="a", params=rng.choice(out_of_range))},
            "invalid_argument",
            "id",
        ),
        lambda: (
            {"v": str(PROTOCOL_VERSION), "body": body(prompt="a", priority=rng.choice([-1001, 1001]))},
            "invalid_argument",
            "id",
        ),
        lambda: (
            {"v": str(PROTOCOL_VERSION), "body": body(prompt="a", timeout_s=rng.choice([0, -5, 1e9]))},
            "invalid_argument",
            "id",
        ),
        lambda: ({"v": str(PROTOCOL_VERSION), "body": body(**rng.choice(unknown_fields))}, "invalid_argument", "id"),
        lambda: ({"v": str(PROTOCOL_VERSION), "body": body(**rng.choice(exactly_one))}, "invalid_argument", "id"),
        lambda: (
            {"v": str(PROTOCOL_VERSION), "body": body(input_ids=[rng.choice([256, 10**6, 2**70])])},
            "invalid_argument",
            "id",
        ),
        lambda: ({"v": str(PROTOCOL_VERSION), "body": body(input_ids=[1, -1])}, "invalid_argument", "id"),
        lambda: (
            {"v": str(PROTOCOL_VERSION), "body": body(prompt="p" * rng.randint(MAX_MODEL_LEN, 500))},
            "prompt_too_long",
            "id",
        ),
    ]
    while True:
        fields, code, needs_id = rng.choice(makers)()
        if needs_id:
            fields = {"id": f"bad-{uuid.uuid4().hex}", **fields}
        yield fields, code


@pytest.mark.slow
def test_a_thousand_bad_entries_fail_with_their_codes_and_fifty_good_jobs_run(redis_server, tmp_path):
    queue = f"fuzz-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(
        redis_server.url,
        queue,
        f"{queue}-w",
        tmp_path,
        "--max-body-bytes",
        str(MAX_BODY_BYTES),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        model="echo",
    )
    start_workers([worker])
    pid = worker.heartbeat()["pid"]
    raw = redis.Redis.from_url(redis_server.url)  # bytes in, so that any byte string can be written
    rng = random.Random(6)
    generated = bad_entries(rng)
    bad: dict[str, str] = {}  # job id -> expected code
    good: dict[str, str] = {}  # job id -> expected text
    try:
        with make_client("sync", redis_server.url, queue) as client:
            for i in range(1050):
                if i % GOOD_EVERY == 0:
                    prompt = f"good {i} " + rng.choice(["é", "日本", "✓", "ok"])
                    good[client.submit(prompt, max_tokens=MAX_MODEL_LEN - 1)] = prompt
                    continue
                fields, code = next(generated)
                entry_id = raw.xadd(KEYS.queue(queue), fields).decode()
                job_id = fields.get("id")
                if isinstance(job_id, str) and job_id.startswith("bad-"):
                    bad[job_id] = code
                else:
                    bad[f"entry-{entry_id}"] = code
                assert worker.running, worker.log()
            assert (len(bad), len(good)) == (1000, 50)
            for job_id, prompt in good.items():
                result = client.result(job_id, timeout=60)
                assert (result.status, result.text) == ("done", prompt), job_id
            codes = {}
            for job_id, code in bad.items():
                with pytest.raises(JobFailed) as e:
                    client.result(job_id, timeout=60)
                assert e.value.result.status == "failed"
                assert (e.value.code, job_id) == (code, job_id), e.value.message
                assert e.value.message
                codes[code] = codes.get(code, 0) + 1
        assert worker.running and worker.heartbeat()["pid"] == pid
        assert eventually(lambda: queue_depth(raw, queue) == 0)  # the last ack follows the last result
        assert "Traceback" not in worker.log()
        print(f"\nfuzz: 1,000 bad entries by code: {dict(sorted(codes.items()))}")
    finally:
        raw.close()
        worker.stop()
