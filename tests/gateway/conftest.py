"""One redis-server, one worker on the `tiny` preset (a real model: tokenizer, chat template,
sampling, logprobs; serving two LoRA adapters, tests/gateway/test_lora.py), one on the echo
engine (the prompt back, byte by byte: fast, and every token known in advance), and one gateway
in front of them, shared by the package's tests (a tiny worker takes many seconds to start) and
stopped when they end, as tests/board's: idle, the set polls Redis (~1.2 s of CPU a minute), and
a session's would poll for the rest of its pytest process."""

import json

import openai
import pytest

from tests.gateway.support import (
    ECHO_QUEUE,
    KEEPALIVE_S,
    LORA_ADAPTERS,
    PARKED_MODEL,
    PARKED_QUEUE,
    STREAM_HOLD_S,
    TINY_QUEUE,
)
from tests.support.gateways import GatewayProcess
from tests.support.workers import WorkerProcess, start_workers
from worker.model.presets import PRESETS
from worker.model.random_adapter import write_random_adapter


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory) -> dict[str, str]:
    """The tiny worker's LoRA adapters, by name (PEFT's layout, random weights)."""
    root = tmp_path_factory.mktemp("lora")
    return {
        name: str(write_random_adapter(root / name, PRESETS["tiny"].config, **args))
        for name, args in LORA_ADAPTERS.items()
    }


@pytest.fixture(scope="package")
def gateway_workers(redis_server, lora_adapters, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gateway-workers")
    lora = ["--lora-modules", *(f"{name}={path}" for name, path in lora_adapters.items()), "--max-lora-rank", "16"]
    workers = [
        WorkerProcess(redis_server.url, TINY_QUEUE, "gw-tiny-1", log_dir, *lora, model="tiny"),
        WorkerProcess(redis_server.url, ECHO_QUEUE, "gw-echo-1", log_dir, model="echo"),
    ]
    try:
        yield start_workers(workers)
    finally:
        for w in workers:
            w.stop()


@pytest.fixture(scope="package")
def gateway(redis_server, gateway_workers, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("gateway")
    process = GatewayProcess(
        redis_server.url,
        log_dir,
        "--keepalive-s",
        str(KEEPALIVE_S),
        "--stream-hold-s",
        str(STREAM_HOLD_S),
        "--workers-refresh-s",
        "0.2",
        "--models",
        json.dumps({PARKED_MODEL: PARKED_QUEUE}),
    )
    try:
        yield process.start()
    finally:
        process.stop()


@pytest.fixture
def sdk(gateway):
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


@pytest.fixture
async def async_sdk(gateway):
    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    yield client
    await client.close()
