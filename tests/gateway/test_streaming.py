"""Server-Sent Events: the raw framing, keep-alives during a queue wait, 100 streams at once, and
what a client's disconnect does to its job."""

import asyncio
import json
import subprocess
import time

import httpx
import openai
import pytest

from harness.polling import eventually
from producer_client import Client
from tests.gateway.support import ECHO_QUEUE, KEEPALIVE_S, PARKED_MODEL, PARKED_QUEUE, TINY_QUEUE
from tests.support.gateways import GatewayProcess
from tests.support.workers import WorkerProcess


def test_curl_sees_data_lines_then_done(gateway):
    body = {"model": "echo", "prompt": "hi there", "max_tokens": 32, "stream": True}
    out = subprocess.run(
        [
            "curl",
            "-sN",
            "-H",
            "Content-Type: application/json",
            "-d",
            json.dumps(body),
            f"{gateway.url}/v1/completions",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    events = out.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert "".join(c["choices"][0]["text"] for c in chunks) == "hi there"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_stream_tells_proxies_to_pass_it_on_unbuffered_and_caches_to_keep_none(gateway, sdk):
    # nginx, and the ingress controllers built on it, buffer an upstream's answer unless it says
    # X-Accel-Buffering: no: behind one, the tokens would reach the client in 4-8 KiB lumps.
    chat = sdk.chat.completions.with_raw_response.create(
        model="echo", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
    )
    text = sdk.completions.with_raw_response.create(model="echo", prompt="hi", max_tokens=4, stream=True)
    for raw in (chat, text):
        assert raw.headers["content-type"].startswith("text/event-stream")
        assert (raw.headers.get("x-accel-buffering"), raw.headers.get("cache-control")) == ("no", "no-cache")
        assert raw.headers["x-mili-job-ids"]  # the request's own headers are kept beside
        raw.parse().close()


@pytest.mark.timing
async def test_waiting_streams_get_a_keepalive_every_interval_then_their_tokens(gateway, redis_server, tmp_path):
    waited_s = 8 * KEEPALIVE_S
    prompts = [f"stream {i} waited" for i in range(4)]

    async def read(client: httpx.AsyncClient, prompt: str, started: asyncio.Event) -> tuple[int, str, list[float]]:
        body = {"model": PARKED_MODEL, "prompt": prompt, "max_tokens": 64, "stream": True}
        keepalives: list[float] = []
        text = ""
        async with client.stream("POST", f"{gateway.url}/v1/completions", json=body) as response:
            opened = time.monotonic()
            started.set()
            async for line in response.aiter_lines():
                if line == ": keep-alive":
                    keepalives.append(time.monotonic() - opened)
                elif line.startswith("data: {"):
                    text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
        return response.status_code, text, keepalives

    async with httpx.AsyncClient(timeout=30) as client:
        opened = [asyncio.Event() for _ in prompts]
        streams = [asyncio.create_task(read(client, p, e)) for p, e in zip(prompts, opened)]
        for e in opened:
            await e.wait()
        await asyncio.sleep(waited_s)  # no worker serves the queue: the jobs wait
        worker = WorkerProcess(redis_server.url, PARKED_QUEUE, "gw-parked-echo", tmp_path, model="echo")
        try:
            await asyncio.to_thread(lambda: worker.start().wait_ready())
            answers = await asyncio.gather(*streams)
        finally:
            worker.stop()
    for prompt, (status, text, keepalives) in zip(prompts, answers):
        assert status == 200 and text == prompt
        assert len(keepalives) >= waited_s / KEEPALIVE_S - 2, keepalives
        # One per quiet interval, not more. The times are taken here, as lines arrive, so each carries
        # this loop's delivery delay (tens of ms on a loaded machine): the rate is measured over the
        # whole wait, where that delay is a few per cent, and no gap may be a second line sent
        # within the same interval.
        gaps = [b - a for a, b in zip(keepalives, keepalives[1:])]
        assert (keepalives[-1] - keepalives[0]) / len(gaps) >= KEEPALIVE_S * 0.95, gaps
        assert all(gap >= KEEPALIVE_S * 0.5 for gap in gaps), gaps


async def test_100_concurrent_streams_each_get_every_token_once(gateway, redis_server):
    sdk = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    prompts = [f"request {i:03d}: the quick brown fox" for i in range(100)]

    async def stream(prompt: str) -> tuple[str, str, int]:
        async with sdk.completions.with_streaming_response.create(
            model="echo",
            prompt=prompt,
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
        ) as raw:
            chunks = [c async for c in await raw.parse()]
            job_id = raw.headers["x-mili-job-ids"]
        return job_id, "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

    try:
        answers = await asyncio.gather(*(stream(p) for p in prompts))
    finally:
        await sdk.close()
    with Client(redis_server.url, ECHO_QUEUE) as client:
        for prompt, (job_id, text, tokens) in zip(prompts, answers):
            assert text == prompt == client.result(job_id, timeout=10).text
            assert tokens == len(prompt.encode())
    assert len({job_id for job_id, _, _ in answers}) == 100


def open_stream_and_leave(url: str, body: dict, chunks: int) -> str:
    """Read `chunks` data lines of a stream, then close the connection; returns the job id."""
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        seen = 0
        while seen < chunks:
            seen += next(lines).startswith("data: {")
        return response.headers["x-mili-job-ids"]


LONG = {
    "model": "tiny",
    "prompt": "Once upon a time",
    "max_tokens": 2000,
    "temperature": 0,
    "ignore_eos": True,
    "stream": True,
}


@pytest.mark.timing  # tokens made while the cancel travels: a bound on its time, stretched by tests beside it
def test_a_client_that_disconnects_mid_stream_cancels_its_job_within_a_step(gateway, redis_server):
    with Client(redis_server.url, TINY_QUEUE) as client:
        left = []  # (job id, tokens Redis held when its client left)
        for _ in range(3):
            job_id = open_stream_and_leave(gateway.url, LONG, chunks=5)
            left.append((job_id, client.status(job_id).tokens))
        assert eventually(lambda: all(client.status(j).status == "cancelled" for j, _ in left), timeout=5)
        for job_id, tokens_at_leave in left:
            result = client.result(job_id, timeout=5)
            assert result.finish_reason == "abort"
            # The step running when the cancel lands, and the one that publishes the abort; the rest
            # is slack for this shared 2-core machine. Uncancelled, the job would make 2000.
            assert result.usage.completion_tokens - tokens_at_leave <= 5, (result.usage, tokens_at_leave)


def test_with_cancel_on_disconnect_off_the_job_runs_to_its_end(redis_server, gateway_workers, tmp_path):
    gw = GatewayProcess(redis_server.url, tmp_path, "--no-cancel-on-disconnect").start()
    try:
        with Client(redis_server.url, TINY_QUEUE) as client:
            job_id = open_stream_and_leave(gw.url, {**LONG, "max_tokens": 40}, chunks=2)
            result = client.result(job_id, timeout=30)
        assert (result.status, result.usage.completion_tokens) == ("done", 40)
    finally:
        gw.stop()
