"""The demo behind the README's run command: a private Redis, one worker process, and a few
jobs sent through the producer client (one streamed live, one chat, one prompt under the base
model and two LoRA adapters in one batch), one chat through the OpenAI-compatible gateway with the
official `openai` SDK, then the results and the worker's own metrics, and a clean shutdown of all.
The adapters are random ones written in PEFT's layout for the model (worker/model/random_adapter.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from producer_client import Client, JobResult, steps
from producer_client.protocol import registry
from worker.embedded_redis import EmbeddedRedis, free_port, stop_process

WORKER_NAME = "demo-worker"
WORKER_START_TIMEOUT_S = 600.0  # the first run writes the preset's checkpoint
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Redis streams are"]
MAX_TOKENS = 24


def demo(model: str) -> int:
    with tempfile.TemporaryDirectory(prefix="mili-demo-") as tmp, EmbeddedRedis() as server:
        log_path = Path(tmp) / "worker.log"
        print(f"redis-server (embedded): {server.url}")
        adapters = write_adapters(model, Path(tmp))
        with log_path.open("w") as log_file:
            worker = start_worker(model, server.url, log_file, adapters)
            log = LogTail(log_path)
            try:
                with Client(server.url) as client:
                    port = wait_for_worker(client, worker, log)
                    jobs = run_jobs(client) + run_adapter_jobs(client, list(adapters))
                    jobs += chat_through_gateway(server.url, model, Path(tmp) / "gateway.log")
                    print_metrics(port, jobs)
            finally:
                stop_process(worker, timeout_s=60)  # SIGTERM: the worker drains and exits
        print(f"\nworker log since it started ({log_path.name}):")
        log.show(final=True)
    print("\nworker and redis-server stopped.")
    return 0


def write_adapters(model: str, directory: Path) -> dict[str, Path]:
    """Two random LoRA adapters of the model, by name. The echo engine serves names alone (it reads
    no adapter), so for it none is written."""
    from worker.model.config import read_json
    from worker.model.presets import resolve_model_path
    from worker.model.random_adapter import write_random_adapter

    names = {"demo-sql": (8, ("q_proj", "v_proj")), "demo-chat": (16, ("q_proj", "k_proj", "v_proj", "o_proj"))}
    if model == "echo":
        return {name: directory / name for name in names}
    config = read_json(resolve_model_path(model) / "config.json")
    return {
        name: write_random_adapter(directory / name, config, rank, targets, seed=rank)
        for name, (rank, targets) in names.items()
    }


def start_worker(model: str, url: str, log_file, adapters: dict[str, Path]) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "worker",
        "serve",
        "--model",
        model,
        "--redis",
        url,
        "--name",
        WORKER_NAME,
        "--metrics-host",
        "127.0.0.1",
        "--metrics-port",
        "0",
        "--kv-cache-mib",
        "256",
        "--lora-modules",
        *(f"{name}={path}" for name, path in adapters.items()),
    ]
    # Leave a core to redis-server and this client: torch's threads spin while they wait, and
    # on a small machine an oversubscribed worker runs several times slower.
    env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) - 1)), **os.environ}
    print(f"worker: {' '.join(command[1:])} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']})")
    return subprocess.Popen(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)


class LogTail:
    """The worker's log, shown as it is written: each whole line once, indented."""

    def __init__(self, path: Path):
        self.path = path
        self.offset = 0

    def show(self, final: bool = False) -> None:
        """Print the lines written since the last call (`final`: a last line without its newline too)."""
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = len(data) if final else data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].decode(errors="replace").splitlines():
            print(f"  | {line}", flush=True)


def wait_for_worker(client: Client, worker: subprocess.Popen, log: LogTail) -> int:
    """Wait for the worker's first heartbeat, showing its log's progress lines meanwhile (a first
    start writes the preset and compiles for a minute or more); returns its metrics port."""
    print(f"waiting for the worker to load {WORKER_NAME}'s model (its log follows):", flush=True)
    deadline = time.monotonic() + WORKER_START_TIMEOUT_S
    while WORKER_NAME not in client.queue_stats().workers:
        log.show()
        if worker.poll() is not None:
            log.show(final=True)
            raise SystemExit(f"the worker exited with code {worker.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"the worker did not start within {WORKER_START_TIMEOUT_S:g}s")
        time.sleep(0.1)
    log.show()
    (heartbeat,) = steps.run(client.redis, registry.heartbeats(client.keys, [WORKER_NAME]))
    return int(heartbeat["metrics_port"])


def run_jobs(client: Client) -> int:
    """Returns how many jobs ran."""
    print("\n== one job, streamed token by token (greedy, random weights: expect gibberish) ==")
    job_id = client.submit("Once upon a time", max_tokens=MAX_TOKENS, temperature=0.0)
    print(f"[{job_id}] Once upon a time", end="", flush=True)
    for delta in client.stream(job_id, timeout=120):
        print(delta.text, end="", flush=True)
    print()
    show(client.result(job_id, timeout=10))

    print("\n== a chat job (messages through the checkpoint's chat template) ==")
    chat = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime number."}]
    show(client.generate(messages=chat, max_tokens=MAX_TOKENS, temperature=0.0, timeout=120))

    print(f"\n== {len(PROMPTS)} jobs submitted at once (batched by the engine), one idempotent retry ==")
    ids = [
        client.submit(p, max_tokens=MAX_TOKENS, temperature=0.0, request_id=f"demo-{i}") for i, p in enumerate(PROMPTS)
    ]
    again = client.submit(PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0.0, request_id="demo-0")
    print(f"resubmitting request_id demo-0 returned the same job: {again == ids[0]}")
    print(f"queue right after: {client.queue_stats().model_dump()}")
    for prompt, job_id in zip(PROMPTS, ids):
        result = client.result(job_id, timeout=120)
        print(f"{prompt!r} ->")
        show(result)
    return 2 + len(PROMPTS)


def run_adapter_jobs(client: Client, adapters: list[str]) -> int:
    """One prompt under the base model and each adapter, submitted at once: one batch of the engine,
    its rows on different adapters. Returns how many jobs ran."""
    print(f"\n== one prompt under the base model and LoRA adapters {', '.join(adapters)} (one batch) ==")
    names = [None, *adapters]
    ids = [client.submit("Redis streams are", max_tokens=MAX_TOKENS, temperature=0.0, adapter=a) for a in names]
    for name, job_id in zip(names, ids):
        print(f"adapter {name or '(none: the base model)'} ->")
        show(client.result(job_id, timeout=120))
    return len(ids)


def chat_through_gateway(redis_url: str, model: str, log_path: Path) -> int:
    """One chat through `python -m gateway` with the official openai SDK; returns the jobs it ran."""
    from openai import OpenAI

    port = free_port()
    command = [sys.executable, "-m", "gateway", "--redis", redis_url, "--port", str(port), "--log-level", "WARNING"]
    print(f"\n== the same through the OpenAI-compatible gateway: {' '.join(command[1:])} ==")
    with log_path.open("w") as log_file:
        gateway = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        base_url = f"http://127.0.0.1:{port}/v1"
        wait_for_gateway(f"http://127.0.0.1:{port}/health", gateway, log_path)
        openai = OpenAI(base_url=base_url, api_key="unused")
        print(f'OpenAI(base_url="{base_url}").chat.completions.create(model="{model}", messages=[...])')
        reply = openai.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Name a prime number."}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        print(
            f"  {reply.choices[0].message.content!r} ({reply.choices[0].finish_reason}, {reply.usage.total_tokens} tokens)"
        )
    finally:
        gateway.terminate()
        gateway.wait(timeout=30)
    return 1


def wait_for_gateway(health_url: str, gateway: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(health_url, timeout=5)
            return
        except OSError:
            if gateway.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the gateway did not start:\n{log_path.read_text()}") from None
            time.sleep(0.1)


def show(result: JobResult) -> None:
    t, u = result.timings, result.usage
    print(f"  text: {result.text!r}")
    print(
        f"  {result.status} ({result.finish_reason}), {u.prompt_tokens} prompt + {u.completion_tokens} output tokens "
        f"({u.cached_prompt_tokens} cached); queue {t.queue_s * 1000:.1f} ms, first token {t.ttft_s * 1000:.1f} ms, "
        f"total {t.e2e_s * 1000:.1f} ms; worker {result.worker}"
    )


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("mili_")
        for s in family.samples
    }


def print_metrics(port: int, jobs: int) -> None:
    # The worker counts a job just after its result goes out, so the last one may lag a moment.
    deadline = time.monotonic() + 5
    while True:
        samples = scrape(port)
        counted = sum(v for (name, _), v in samples.items() if name == "mili_jobs_total")
        if counted >= jobs or time.monotonic() > deadline:
            break
        time.sleep(0.05)

    def value(name: str, **labels) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    def mean_ms(name: str) -> str:
        count = value(f"{name}_count")
        return f"{value(f'{name}_sum') / count * 1000:.1f} ms" if count else "-"

    outcomes = ", ".join(
        f"{o} {value('mili_jobs_total', outcome=o):g}" for o in ("done", "failed", "cancelled", "expired")
    )
    print(f"\n== worker metrics (http://127.0.0.1:{port}/metrics) ==")
    print(f"  jobs: {outcomes}")
    print(
        f"  tokens: {value('mili_prompt_tokens_total'):g} prompt, {value('mili_generation_tokens_total'):g} generated"
    )
    print(
        f"  mean time to first token {mean_ms('mili_time_to_first_token_seconds')}, per output token "
        f"{mean_ms('mili_time_per_output_token_seconds')}, end to end {mean_ms('mili_e2e_request_latency_seconds')}"
    )
    queries = value("mili_prefix_cache_queries_total")
    hits = value("mili_prefix_cache_hits_total")
    print(
        f"  prefix cache: {hits:g} of {queries:g} prompt tokens hit; KV cache usage {value('mili_kv_cache_usage_perc'):.1%}"
    )
