"""Our Qwen3ForCausalLM against transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM on the
same random checkpoints, in fp32.

Logit error is measured relative to the logits' scale: max|ours - ref| / max|ref|, for the
whole batch and for every position on its own (a single wrong position cannot hide in the max).
"""

import pytest
import torch

from harness.model_configs import CONFIGS
from harness.paged_model import PagedModelRunner
from worker.model.loader import load_model
from worker.model.presets import write_random_checkpoint

REL_TOL = 1e-4
VOCAB = 2048


PROMPT_LENS = (1, 7, 19, 40)


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


def assert_logits_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    assert ours.shape == ref.shape
    assert ours.dtype == torch.float32
    worst = max(rel_error(o, r) for o, r in zip(ours, ref))
    assert rel_error(ours, ref) <= REL_TOL
    assert worst <= REL_TOL, f"worst position's relative error {worst:.2e}"


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request, tmp_path_factory):
    # Weights 15x transformers' init scale: at 0.02 a random model repeats one token, so greedy
    # parity would not exercise decode attention; at 0.3 every continuation wanders.
    config = {
        **CONFIGS[request.param],
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "initializer_range": 0.3,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp(request.param), config, seed=7, norm_std=0.1)
    from transformers import AutoModelForCausalLM

    ours = load_model(ckpt, dtype=torch.float32).model
    ref = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    return ours, ref


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.inference_mode()
def reference_logits(ref, prompt: list[int]) -> torch.Tensor:
    return ref(torch.tensor([prompt])).logits[0].float()


def test_batched_varlen_prefill_logits_match_transformers(models, prompts):
    ours, ref = models
    runner = PagedModelRunner(ours)
    seqs = [runner.add_sequence() for _ in prompts]
    logits = runner.extend(dict(zip(seqs, prompts)))
    for prompt, got in zip(prompts, logits):
        assert_logits_close(got, reference_logits(ref, prompt))


def test_chunked_prefill_over_cached_prefix_matches_full_prefill(models, prompts):
    ours, ref = models
    # Per prompt, the chunk sizes of successive steps; a step mixes long chunks with q_len 1 ones.
    chunk_plans = [[1], [3, 1, 3], [1, 10, 8], [16, 1, 23]]
    runner = PagedModelRunner(ours)
    seqs = [runner.add_sequence() for _ in prompts]
    got = {s: [] for s in seqs}
    for step in range(max(map(len, chunk_plans))):
        chunks = {}
        for s, prompt, plan in zip(seqs, prompts, chunk_plans):
            if step < len(plan):
                start = sum(plan[:step])
                chunks[s] = prompt[start : start + plan[step]]
        for s, logits in zip(chunks, runner.extend(chunks)):
            got[s].append(logits)
    for s, prompt in zip(seqs, prompts):
        assert_logits_close(torch.cat(got[s]), reference_logits(ref, prompt))


def test_batched_greedy_continuation_matches_transformers_generate(models, prompts):
    ours, ref = models
    new_tokens = 32
    runner = PagedModelRunner(ours)
    seqs = [runner.add_sequence() for _ in prompts]
    last = [logits[-1].argmax().item() for logits in runner.extend(dict(zip(seqs, prompts)))]
    generated = [[t] for t in last]
    for _ in range(new_tokens - 1):
        last = runner.decode(dict(zip(seqs, last))).argmax(-1).tolist()
        for out, t in zip(generated, last):
            out.append(t)

    for prompt, out in zip(prompts, generated):
        with torch.inference_mode():
            expected = ref.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert out == expected
    # A continuation that repeats one token would prove little about decode attention.
    assert all(len(set(out)) > 16 for out in generated)
