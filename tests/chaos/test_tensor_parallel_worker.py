"""A worker of two ranks (gloo on the CPU) through the whole service: a real redis-server, worker
processes, the real client. It serves jobs as one worker (one heartbeat, its device the ranks'),
with the greedy tokens one rank gives, and drains and stops its ranks on SIGTERM. A rank killed
with -9, or stopped (a hang, past --tensor-parallel-timeout-s), takes the worker down with one
`rank_failed` line and leaves no rank behind; its jobs finish on another worker, equal to a
fault-free run, each with one final result. A worker asked for more ranks than the model's heads
split into, or than there are GPUs, refuses to start with one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from harness.model_configs import SMALL_DENSE
from harness.polling import eventually
from harness.processes import REPO, alive
from producer_client import Client
from tests.support.jobs import assert_one_final_result, runs
from tests.support.workers import WorkerProcess, start_workers
from worker.model.presets import qwen3_config, write_random_checkpoint
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files

ENGINE_FLAGS = ("--max-model-len", "256", "--page-size", "4")
# The serving test's ranks: 2 GPUs over NCCL where there are (the tp stage of the GPU acceptance
# script), gloo ranks on the CPU elsewhere. Faults are done to CPU ranks: a stopped NCCL rank is
# found by NCCL's own watchdog, which aborts the process.
SERVE_DEVICE = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
RECLAIM_FLAGS = ("--claim-idle-ms", "2000", "--reclaim-interval-s", "0.2")
HANG_TIMEOUT_S = 3.0
PROMPTS = [[(7 * i + j) % 2000 + 10 for j in range(3 + 4 * i)] for i in range(8)]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """Weights at 0.3, so greedy outputs vary from token to token; 4 heads, 2 KV heads."""
    config = qwen3_config(**SMALL_DENSE)
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("tp_worker_ckpt"), config, seed=11, norm_std=0.1)
    write_qwen3_tokenizer_files(ckpt)
    return ckpt


@pytest.fixture(scope="module")
def fault_free(checkpoint):
    """The outputs of one rank on `device`, uninterrupted: fault_free(device)."""
    from producer_client.schema import SamplingParams
    from worker.engine import Engine

    outputs: dict[str, list[list[int]]] = {}

    def run(device: str) -> list[list[int]]:
        if device not in outputs:
            engine = Engine.from_pretrained(checkpoint, device=device, max_model_len=256, page_size=4, num_pages=512)
            params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
            outputs[device] = [o.token_ids for o in engine.generate(PROMPTS, params)]
        return outputs[device]

    return run


def tp_worker(redis_url: str, queue: str, log_dir: Path, checkpoint: Path, *flags: str) -> WorkerProcess:
    return WorkerProcess(
        redis_url,
        queue,
        f"{queue}-tp",
        log_dir,
        "--tensor-parallel-size",
        "2",
        *ENGINE_FLAGS,
        *flags,
        model=str(checkpoint),
    )


def rank_pids(worker: WorkerProcess) -> list[int]:
    """The other ranks' pids, from the worker's start-up line, which names every rank's: rank 0 is
    the worker's own process."""
    match = re.search(r"tensor parallelism: 2 ranks on .* \(rank 0: pid (\d+), rank 1: pid (\d+)\)", worker.log())
    assert match is not None and int(match.group(1)) == worker.process.pid, worker.log()
    return [int(match.group(2))]


def submit_all(client: Client) -> list[str]:
    return [client.submit(input_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) for p in PROMPTS]


@pytest.mark.cuda(gpus=2)
def test_a_worker_of_two_ranks_serves_jobs_as_one_worker_and_drains_with_its_ranks(
    redis_server,
    redis_client,
    checkpoint,
    fault_free,
    tmp_path,
):
    queue = f"tp-{uuid.uuid4().hex[:6]}"
    device_flags = ("--device", SERVE_DEVICE, "--gpu-memory-utilization", "0.05")
    worker = start_workers([tp_worker(redis_server.url, queue, tmp_path, checkpoint, *device_flags)])[0]
    try:
        others = rank_pids(worker)
        assert worker.heartbeat()["device"] == ("cuda:0,cuda:1" if SERVE_DEVICE == "cuda" else "cpu,cpu")
        with Client(redis_server.url, queue) as client:
            jobs = submit_all(client)
            results = [client.result(job, timeout=300) for job in jobs]
        assert [r.token_ids for r in results] == fault_free(SERVE_DEVICE)
        assert {r.worker for r in results} == {worker.name}
        assert worker.terminate(timeout=60) == 0  # SIGTERM: the drain ends, the ranks stop with the worker
        assert eventually(lambda: not any(alive(pid) for pid in others), timeout=10)
        assert "rank_failed" not in worker.log()
    finally:
        worker.stop()


@pytest.fixture(scope="module")
def survivor(redis_server, checkpoint, tmp_path_factory):
    """A worker of one rank on the queue of the fault tests: it takes the failed worker's jobs over."""
    queue = f"tp-fault-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(
        redis_server.url,
        queue,
        f"{queue}-survivor",
        tmp_path_factory.mktemp("survivor"),
        "--device",
        "cpu",
        "--max-running",
        "2",
        *ENGINE_FLAGS,
        *RECLAIM_FLAGS,
        model=str(checkpoint),
    )
    try:
        yield start_workers([worker])[0]
    finally:
        worker.stop()


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_rank_killed_or_hung_takes_the_worker_down_and_its_jobs_finish_elsewhere(
    fault,
    redis_server,
    redis_client,
    checkpoint,
    fault_free,
    survivor,
    tmp_path,
):
    victim = tp_worker(
        redis_server.url,
        survivor.queue,
        tmp_path,
        checkpoint,
        "--device",
        "cpu",
        *RECLAIM_FLAGS,
        "--tensor-parallel-timeout-s",
        str(HANG_TIMEOUT_S),
    )
    start_workers([victim])
    with Client(redis_server.url, survivor.queue) as client:
        try:
            other = rank_pids(victim)[0]
            jobs = submit_all(client)
            # The survivor runs two at a time: the worker of two ranks holds the rest, and is generating.
            assert eventually(
                lambda: any(r[0]["worker"] == victim.name and r[1] for job in jobs for r in runs(redis_client, job)),
                timeout=120,
            )
            os.kill(other, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            struck = time.monotonic()
            code = victim.process.wait(timeout=HANG_TIMEOUT_S + 60)
            down_s = time.monotonic() - struck
            results = [client.result(job, timeout=300) for job in jobs]
        finally:
            victim.stop()
    assert code == 3
    error_lines = [line for line in victim.log().splitlines() if line.startswith("error: ")]
    if fault == "kill":
        assert error_lines == [f"error: rank_failed: tensor-parallel rank 1 (pid {other}) was killed by SIGKILL"]
        assert down_s < 10
    else:  # the collective the stopped rank never joins times out
        assert len(error_lines) == 1 and error_lines[0].startswith("error: rank_failed: tensor-parallel rank 0: ")
        assert HANG_TIMEOUT_S * 0.9 <= down_s < HANG_TIMEOUT_S + 20, down_s
    assert eventually(lambda: not alive(other), timeout=10)  # it died with the worker, stopped or not
    assert [r.token_ids for r in results] == fault_free("cpu")
    assert {r.status for r in results} == {"done"}
    taken_over = [
        job
        for job in jobs
        if [run[0]["worker"] for run in runs(redis_client, job)][-2:] == [victim.name, survivor.name]
    ]
    assert taken_over  # jobs the failed worker had begun finished on the survivor
    for job in jobs:
        assert_one_final_result(redis_client, job)


def run_worker(*flags: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "worker", "serve", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_worker_refuses_a_split_the_heads_do_not_allow_with_one_line(redis_server, checkpoint):
    done = run_worker(
        "--model", str(checkpoint), "--redis", redis_server.url, "--metrics-port", "0", "--tensor-parallel-size", "3"
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: invalid_argument: tensor_parallel_size: 3 does not divide num_attention_heads 4; "
        "does not divide intermediate_size 128"
    )
    assert "Traceback" not in done.stderr


def test_a_refusal_comes_before_a_preset_is_written_or_a_weight_read(redis_server, tmp_path):
    """What config.json alone refuses is refused first: a preset's first use writes its checkpoint
    (tens of seconds), and the checkpoint's check builds a model on the meta device (seconds)."""
    done = run_worker(
        "--model", "tiny", "--redis", redis_server.url, "--metrics-port", "0", "--tensor-parallel-size", "3",
        env={"MILI_CACHE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: invalid_argument: tensor_parallel_size: 3 does not divide num_attention_heads 4"
    )
    assert not (tmp_path / "presets").exists() and "loaded" not in done.stderr


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has the GPUs")
def test_a_worker_refuses_more_ranks_than_visible_gpus_with_one_line(redis_server, checkpoint):
    done = run_worker(
        "--model",
        str(checkpoint),
        "--redis",
        redis_server.url,
        "--metrics-port",
        "0",
        "--device",
        "cuda",
        "--tensor-parallel-size",
        "2",
    )
    assert done.returncode == 2
    visible = torch.cuda.device_count()
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: invalid_argument: tensor_parallel_size: 2 ranks need GPUs cuda:0..cuda:1, {visible} are visible"
    )


def test_a_worker_whose_loop_never_notices_a_failed_rank_exits_once_the_timeout_has_passed_again():
    # As a worker blocked where no engine call comes (a device wait that never returns): the
    # failure is set, the main thread sleeps on.
    code = (
        "import threading, time\n"
        "from worker.tensor_parallel import exit_after_failure\n"
        "failed = threading.Event()\n"
        "threading.Thread(target=exit_after_failure, args=(failed, 1.0), daemon=True).start()\n"
        "failed.set()\n"
        "time.sleep(60)\n"
    )
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert done.returncode == 3
    assert "a tensor-parallel rank failed 1 s ago and the worker is still up: exiting now" in done.stderr
    assert 1.0 <= elapsed < 30
