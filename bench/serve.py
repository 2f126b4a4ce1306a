"""Serving benchmark: bench/offline.py's workload through Redis, against the offline engine.

One worker process (`python -m worker`) runs the model, an embedded redis-server and producer
processes share its host. In one run it prints:

  1. the offline engine (`Engine.generate`) on the workload: output tokens/s;
  2. the same jobs through the queue, all submitted at once by the producers (input_ids,
     greedy, ignore_eos): output tokens/s from the first submit to the last result received,
     and that as a fraction of (1);
  3. TTFT (enqueue to first token) and TPOT ((last token - first token) / (tokens - 1)), p50
     and p99 over the jobs, from the timings in their results (Redis's and the worker's
     clocks: the same host's).

With --stream the jobs are submitted as streamed and every job has a reader on `stream()` (the
asyncio client, in the producer processes) until it ends, as an SSE client's gateway reads them.

    python -m bench.serve --workload nanovllm            # 256 requests, input and output in [100, 1024]
    python -m bench.serve --model tiny --num-requests 8 --max-prompt 32 --max-output 16 --threads 1   # CPU smoke
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.measure import pct
from harness.processes import start_worker
from producer_client import AsyncClient, Client, JobTimeout  # the producers import nothing heavier
from worker.embedded_redis import EmbeddedRedis, free_port

QUEUE = "bench-serve"
RESULT_TIMEOUT_S = 3600.0
STARTUP_TIMEOUT_S = 1800.0  # loading, profiling and graph capture on a cold machine
WORKER_LOG_LINES = ("KV cache:", "profiled the largest step", "decode CUDA graphs", "engine: max_model_len")


@dataclass
class JobTimes:
    completion_tokens: int
    ttft_s: float
    tpot_s: float | None  # None for one-token jobs


def main() -> None:
    args = parse_args()
    work = workload(args)
    print(
        f"workload {args.workload}: {len(work.prompts)} requests, {sum(map(len, work.prompts))} prompt tokens, "
        f"{work.output_tokens} output tokens; model {args.model} on {args.device}"
    )
    offline_tok_s = args.offline_tok_s or offline_throughput(args, work)
    print(f"offline engine:    {offline_tok_s:,.1f} output tok/s")

    with EmbeddedRedis(port=free_port() if args.tcp else None) as server, tempfile.NamedTemporaryFile("w+") as log:
        worker = start_model_worker(args, server.url, Path(log.name))
        try:
            wait_ready(server.url, worker)
            times, seconds = run_producers(server.url, args.producers, work, args.stream)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
        log.seek(0)
        startup = [line.rstrip() for line in log if any(key in line for key in WORKER_LOG_LINES)]
    produced = [t.completion_tokens for t in times]
    if sorted(produced) != sorted(work.output_lens):
        raise RuntimeError(f"the worker produced {sum(produced)} tokens, asked for {work.output_tokens}")
    queued_tok_s = sum(produced) / seconds
    print(
        f"through the queue: {queued_tok_s:,.1f} output tok/s ({sum(produced)} tokens in {seconds:.1f}s, "
        f"1 worker, {args.producers} producer processes{', every job streamed' if args.stream else ''}) = "
        f"{queued_tok_s / offline_tok_s:.1%} of offline"
    )
    ttft = [t.ttft_s for t in times]
    tpot = [t.tpot_s for t in times if t.tpot_s is not None]
    print(f"TTFT: p50 {pct(ttft, 50) * 1e3:,.1f} ms, p99 {pct(ttft, 99) * 1e3:,.1f} ms")
    if tpot:
        print(f"TPOT: p50 {pct(tpot, 50) * 1e3:,.2f} ms, p99 {pct(tpot, 99) * 1e3:,.2f} ms")
    print("worker startup:\n  " + "\n  ".join(startup))


def parse_args() -> argparse.Namespace:
    # Imported here, in the parent only: producers spawned from this module must not import torch.
    from bench.offline import add_engine_switches, add_kv_cache_mib, add_model_and_workload_args

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_workload_args(p, default_workload="nanovllm")
    p.add_argument("--max-num-batched-tokens", type=int, help="engine setting (default: EngineSettings')")
    p.add_argument("--max-running", type=int, help="engine setting (default: EngineSettings')")
    add_kv_cache_mib(p)
    add_engine_switches(p)
    p.add_argument("--threads", type=int, help="torch CPU threads of the engine, offline and in the worker")
    p.add_argument("--producers", type=int, default=4, help="producer processes, each submitting its share of the jobs")
    p.add_argument("--offline-tok-s", type=float, help="take the offline figure from an earlier run instead")
    p.add_argument(
        "--stream", action="store_true", help="submit the jobs as streamed, each read by stream() to its end"
    )
    p.add_argument("--tcp", action="store_true", help="Redis over TCP on 127.0.0.1 instead of a unix socket")
    return p.parse_args()


def workload(args: argparse.Namespace):
    from bench.offline import workload_from

    return workload_from(args)


def offline_throughput(args: argparse.Namespace, work) -> float:
    """Output tokens/s of Engine.generate on the workload, after a small warm-up, as bench/offline.py
    measures it; the engine is freed afterwards so the worker gets the device's memory."""
    import gc

    import torch

    from bench.offline import engine_settings, make_workload, run_engine
    from worker.engine import Engine
    from worker.model.presets import resolve_model_path

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(
        resolve_model_path(args.model), device=args.device, dtype=args.dtype, **engine_settings(args)
    )
    run_engine(engine, make_workload(2, (16, 16), (4, 4), args.seed + 1))
    result = run_engine(engine, work)
    del engine
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result.tokens_per_s


def start_model_worker(args: argparse.Namespace, url: str, log_path: Path) -> subprocess.Popen:
    flags = ["--device", args.device, "--dtype", args.dtype or "auto", "--log-level", "INFO"]
    from bench.offline import engine_settings

    for name, value in engine_settings(args).items():
        flag = "--" + name.replace("_", "-")
        flags += ([flag] if value else ["--no-" + flag[2:]]) if isinstance(value, bool) else [flag, str(value)]
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else None
    return start_worker(url, QUEUE, *flags, name="bench-serve-worker", model=args.model, log_path=log_path, env=env)


def wait_ready(url: str, worker: subprocess.Popen) -> None:
    """Two short jobs: the worker has loaded, profiled and captured, and its connection and scripts are warm."""
    with Client(url, QUEUE) as client:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        job = client.submit(input_ids=list(range(100, 116)), max_tokens=4, temperature=0.0, ignore_eos=True)
        while True:
            if worker.poll() is not None:
                raise RuntimeError(f"the worker exited with status {worker.returncode} before serving")
            try:
                client.result(job, timeout=5)
                break
            except JobTimeout as e:  # still loading, profiling, capturing
                if time.monotonic() > deadline:
                    raise RuntimeError("the worker did not serve a job in time") from e
        client.generate(input_ids=list(range(200, 216)), max_tokens=4, temperature=0.0, ignore_eos=True, timeout=600)


def run_producers(url: str, procs: int, work, stream: bool) -> tuple[list[JobTimes], float]:
    """Producer process i submits jobs i, i + procs, ... at once, then collects their results.
    Returns every job's times and the seconds from the start signal to the last result."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Event()
    jobs = list(zip(work.prompts, work.output_lens))
    shares = [jobs[i::procs] for i in range(procs)]
    children = [ctx.Process(target=producer, args=(url, share, go, results, stream)) for share in shares if share]
    for c in children:
        c.start()
    if any(results.get() != "ready" for _ in children):
        raise RuntimeError("a producer failed to connect")
    start = time.time()
    go.set()
    parts = [results.get() for _ in children]
    for c in children:
        c.join()
    times = [t for part in parts for t in part["times"]]
    return times, max(part["done_at"] for part in parts) - start


def producer(url: str, share: list[tuple[list[int], int]], go, results, stream: bool) -> None:
    if stream:
        times = asyncio.run(stream_share(url, share, go, results))
        results.put({"times": times, "done_at": time.time()})
        return
    with Client(url, QUEUE) as client:
        client.redis.ping()
        results.put("ready")
        go.wait()
        ids = [client.submit(input_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True) for prompt, n in share]
        times = [job_times(client.result(job_id, timeout=RESULT_TIMEOUT_S)) for job_id in ids]
    results.put({"times": times, "done_at": time.time()})


async def stream_share(url: str, share: list[tuple[list[int], int]], go, results) -> list[JobTimes]:
    """Submit the share as streamed jobs and read each one's deltas to its end, all at once."""
    client = AsyncClient(url, QUEUE, max_connections=len(share) + 4)
    try:
        await asyncio.gather(*(client.redis.ping() for _ in share))  # a connection per reader, made now
        results.put("ready")
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        ids = [
            await client.submit(input_ids=prompt, max_tokens=n, temperature=0.0, ignore_eos=True, stream=True)
            for prompt, n in share
        ]

        async def read(job_id: str) -> JobTimes:
            async for _ in client.stream(job_id, timeout=RESULT_TIMEOUT_S):
                pass
            return job_times(await client.result(job_id, timeout=RESULT_TIMEOUT_S))

        return list(await asyncio.gather(*(read(job_id) for job_id in ids)))
    finally:
        await client.aclose()


def job_times(result) -> JobTimes:
    t, n = result.timings, result.usage.completion_tokens
    tpot = (t.finished_at - t.first_token_at) / (n - 1) if n > 1 else None
    return JobTimes(n, t.ttft_s, tpot)


if __name__ == "__main__":
    main()
