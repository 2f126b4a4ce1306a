"""The whole Qwen3 (and Qwen3-MoE) forward through the Triton kernels against the torch reference path.

On CPU the kernels run in Triton's interpreter; on a CUDA machine they run compiled on the
GPU while the reference runs on CPU. Prefill of a ragged batch (one prompt longer than a
page and a query tile), then greedy decode steps: the same tokens, and fp32 logits close.
"""

import pytest
import torch

from harness.paged_model import PagedModelRunner
from worker.model.loader import load_model
from worker.model.presets import qwen3_config, qwen3_moe_config, write_random_checkpoint

VOCAB = 512
PROMPTS = [[5, 17, 300, 2, 99], list(range(100, 140))]
NEW_TOKENS = 5
CONFIGS = {
    # Weights at 0.3 (not transformers' 0.02) so the random model's continuations wander.
    "gqa2-hd64": qwen3_config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
    "gqa4-hd128": qwen3_config(
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
    ),
    # A sparse layer then a dense one: 6 experts, 2 per token; the prefill's 45 tokens fill blocks of 16 pairs.
    "moe-e6-k2": qwen3_moe_config(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=48,
        num_experts=6,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
    ),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config = {
        **CONFIGS[request.param],
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "initializer_range": 0.3,
        "bos_token_id": None,
        "eos_token_id": None,
        "tie_word_embeddings": True,
    }
    return write_random_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=5, norm_std=0.1)


@torch.inference_mode()
def greedy(checkpoint, dtype: torch.dtype, device: str) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy continuations of PROMPTS and the logits of every step, stacked [steps + 1, B, vocab]."""
    model = load_model(checkpoint, dtype=dtype, device=device).model
    with torch.device(device):  # the runner's caches and metadata follow the model
        runner = PagedModelRunner(model, num_pages=64, page_size=16, seed=1)
        seqs = [runner.add_sequence() for _ in PROMPTS]
        logits = [torch.stack([chunk[-1] for chunk in runner.extend(dict(zip(seqs, PROMPTS)))])]
        tokens = [[] for _ in seqs]
        for _ in range(NEW_TOKENS):
            picks = logits[-1].argmax(-1).tolist()
            for out, pick in zip(tokens, picks):
                out.append(pick)
            logits.append(runner.decode(dict(zip(seqs, picks))))
    return tokens, torch.stack(logits).float().cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_tokens_through_the_kernels_match_the_reference_path(checkpoint, dtype, device, monkeypatch):
    kernel_tokens, kernel_logits = greedy(checkpoint, dtype, device)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reference_tokens, reference_logits = greedy(checkpoint, dtype, "cpu")
    assert kernel_tokens == reference_tokens
    error = ((kernel_logits - reference_logits).abs().max() / reference_logits.abs().max()).item()
    assert error <= (1e-5 if dtype == torch.float32 else 3e-2), f"relative logit error {error:.2e}"
