"""kill -9 a worker while it reads a LoRA adapter: its jobs on that adapter (waiting in its engine
for the read) and on the base model (running beside the read, which holds no step back) are
reclaimed by another worker and finish there, each with one final result and the output a
fault-free run gives.

The read is held for as long as the test needs: the victim's adapter weights file is a named pipe
that nothing writes, so its loader thread blocks in the read while its engine steps on."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest

from harness.polling import eventually
from producer_client import SamplingParams
from producer_client.keys import Keys
from tests.support.clients import make_client
from tests.support.jobs import assert_one_final_result
from tests.support.workers import WorkerProcess, start_workers
from worker.model.lora_adapter import WEIGHTS_FILE
from worker.model.presets import PRESETS
from worker.model.random_adapter import write_random_adapter

KEYS = Keys()
RECLAIM = ("--claim-idle-ms", "2000", "--reclaim-interval-s", "0.2", "--max-running", "8", "--max-model-len", "256")
ADAPTED = [
    {"input_ids": [9707, 1879, 11 + i], "adapter": "sql", "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    for i in range(3)
]
BASE = {"input_ids": [9707, 1879, 42], "max_tokens": 200, "temperature": 0.0, "ignore_eos": True}


def fault_free(adapter_dir) -> list[list[int]]:
    from worker.engine import Engine

    engine = Engine.from_pretrained("tiny", kv_cache_mib=64, lora_modules={"sql": str(adapter_dir)}, max_model_len=256)
    specs = [*ADAPTED, BASE]
    outs = engine.generate(
        [s["input_ids"] for s in specs],
        [SamplingParams(max_tokens=s["max_tokens"], temperature=0.0, ignore_eos=True) for s in specs],
        adapters=[s.get("adapter") for s in specs],
    )
    return [o.token_ids for o in outs]


@pytest.mark.slow
def test_kill_9_while_an_adapter_is_read_loses_no_job(redis_server, redis_client, tmp_path):
    queue = f"lora-kill-{uuid.uuid4().hex[:6]}"
    real = write_random_adapter(tmp_path / "survivor" / "sql", PRESETS["tiny"].config, 8, seed=4)
    blocked = tmp_path / "victim" / "sql"
    shutil.copytree(real, blocked)
    (blocked / WEIGHTS_FILE).unlink()
    os.mkfifo(blocked / WEIGHTS_FILE)  # opening it for reading blocks until a writer comes: none does
    expected = fault_free(real)
    victim = WorkerProcess(
        redis_server.url, queue, f"{queue}-victim", tmp_path, *RECLAIM, "--lora-dir", str(blocked.parent)
    )
    (victim,) = start_workers([victim])
    survivor = None
    try:
        with make_client("sync", redis_server.url, queue) as client:
            ids = [client.submit(**spec) for spec in [*ADAPTED, BASE]]

            def base_job_generating() -> bool:
                worker, tokens = redis_client.hmget(KEYS.job(ids[-1]), "worker", "tokens")
                return worker == victim.name and int(tokens or 0) >= 4

            # The base job runs while the victim's loader is stuck in the read: steps go on.
            assert eventually(base_job_generating, timeout=120), victim.log()
            assert all(redis_client.hget(KEYS.job(j), "worker") == victim.name for j in ids[:-1])
            assert all(int(redis_client.hget(KEYS.job(j), "tokens") or 0) == 0 for j in ids[:-1])
            victim.process.kill()
            victim.process.wait()
            survivor = WorkerProcess(
                redis_server.url, queue, f"{queue}-survivor", tmp_path, *RECLAIM, "--lora-dir", str(real.parent)
            )
            start_workers([survivor])
            results = [client.result(job_id, timeout=180) for job_id in ids]
        assert [r.token_ids for r in results] == expected
        assert {r.worker for r in results} == {survivor.name}
        for job_id in ids:
            assert_one_final_result(redis_client, job_id)
    finally:
        victim.stop()
        if survivor is not None:
            survivor.stop()
