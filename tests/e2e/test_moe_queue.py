"""Qwen3-MoE through the whole service: a real redis-server, one worker process per model (the
tiny-moe preset, and a checkpoint directory of another MoE shape), the real client, several jobs
at once. Greedy results equal transformers' Qwen3MoeForCausalLM on the same weights, in fp32."""

import pytest

from producer_client import Client
from tests.engine.test_moe_engine import transformers_greedy
from tests.support.workers import WorkerProcess, start_workers
from worker.model.presets import qwen3_moe_config, resolve_model_path, write_random_checkpoint
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files

MAX_TOKENS = 10
PROMPTS = [[9707, 11, 1879], [785, 6722, 315, 9625, 374], list(range(1000, 1040)), [151644, 872, 198, 3838]]


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    """Queue name -> the model its worker serves: tiny-moe (by preset name) and a directory
    holding 6 experts, 3 per token, not renormalized, a dense layer between sparse ones."""
    config = qwen3_moe_config(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=6,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
        initializer_range=0.3,
    )
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("moe_queue_ckpt"), config, seed=9, norm_std=0.1)
    write_qwen3_tokenizer_files(ckpt)
    resolve_model_path("tiny-moe")  # written here once, not by the worker while the test waits
    return {"moe-preset": "tiny-moe", "moe-dir": str(ckpt)}


@pytest.fixture(scope="module")
def moe_workers(redis_server, moe_checkpoints, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("moe_workers")
    workers = [
        WorkerProcess(redis_server.url, queue, queue, log_dir, "--max-running", "4", model=model)
        for queue, model in moe_checkpoints.items()
    ]
    try:
        yield start_workers(workers)
    finally:
        for w in workers:
            w.stop()


@pytest.mark.parametrize("queue", ["moe-preset", "moe-dir"])
def test_greedy_jobs_through_the_queue_match_transformers(queue, redis_server, moe_workers, moe_checkpoints):
    with Client(redis_server.url, queue) as client:
        jobs = [client.submit(input_ids=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True) for p in PROMPTS]
        results = [client.result(job, timeout=120) for job in jobs]
    assert [r.finish_reason for r in results] == ["length"] * len(PROMPTS)
    expected = transformers_greedy(resolve_model_path(moe_checkpoints[queue]), PROMPTS, MAX_TOKENS)
    assert [r.token_ids for r in results] == expected
    if queue == "moe-dir":  # weights at 0.3: continuations that vary, so decoding is exercised
        assert all(len(set(out)) > MAX_TOKENS // 2 for out in expected)
    assert {w.queue: w.heartbeat()["model"] for w in moe_workers} == moe_checkpoints
