"""What a float8 KV cache changes in a model's output, against the same model's own cache.

Shared by tests/engine/test_fp8_kv_cache.py and bench/fp8_kv_accuracy.py. A reference run
generates greedily; the float8 run follows the same tokens (teacher forcing: the prompt as one
prefill, then one decode step per token), so every position compares two predictions from the
same context.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from harness.paged_model import PagedModelRunner
from kernels.fp8 import FP8_DTYPE

PAGE_SIZE = 16


@dataclass
class Comparison:
    """Per-position figures of a float8 run against the reference."""

    rel_error: torch.Tensor  # max |logit error| / max |reference logit|
    kl: torch.Tensor  # KL(reference || float8), nats
    agree: torch.Tensor  # bool: the same argmax
    near_tie: torch.Tensor  # bool: the reference's top-2 gap is below this position's largest logit error
    prefill_rel_error: float  # over every prompt position at once
    subnormal_share: float  # of the stored K and V values: below e4m3's normal range (subnormal or zero)

    @property
    def confident_flips(self) -> int:
        """Positions whose argmax changed although the reference's choice was clear of the noise."""
        return int((~self.agree & ~self.near_tie).sum())


def runner_for(model, length: int, cache_dtype=None) -> tuple[PagedModelRunner, int]:
    runner = PagedModelRunner(model, num_pages=length // PAGE_SIZE + 2, page_size=PAGE_SIZE, cache_dtype=cache_dtype)
    return runner, runner.add_sequence()


@torch.inference_mode()
def greedy(model, prompt: list[int], new_tokens: int, cache_dtype=None) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(tokens, prompt logits [P, V], one logits row per generated token [N, V])."""
    runner, seq = runner_for(model, len(prompt) + new_tokens, cache_dtype)
    prompt_logits = runner.extend({seq: prompt})[0]
    rows, tokens = [prompt_logits[-1]], [prompt_logits[-1].argmax().item()]
    for _ in range(new_tokens - 1):
        rows.append(runner.decode({seq: tokens[-1]})[0])
        tokens.append(rows[-1].argmax().item())
    return tokens, prompt_logits, torch.stack(rows)


@torch.inference_mode()
def teacher_forced_fp8(model, prompt: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """A float8 cache's (prompt logits, one row per token, share of stored values below normal)."""
    runner, seq = runner_for(model, len(prompt) + len(tokens), FP8_DTYPE)
    prompt_logits = runner.extend({seq: prompt})[0]
    rows = [prompt_logits[-1]] + [runner.decode({seq: t})[0] for t in tokens[:-1]]
    return prompt_logits, torch.stack(rows), subnormal_share(runner, len(prompt) + len(tokens) - 1)


def subnormal_share(runner: PagedModelRunner, length: int) -> float:
    pages = torch.tensor(runner.pages[0], device=runner.kv_caches[0][0].device)
    stored = torch.cat([cache[pages].flatten(0, 1)[:length].flatten() for pair in runner.kv_caches for cache in pair])
    exponent_bits = (stored.view(torch.uint8) >> 3) & 0xF
    return (exponent_bits == 0).float().mean().item()


def compare(
    ref_prompt: torch.Tensor, ref: torch.Tensor, got_prompt: torch.Tensor, got: torch.Tensor, subnormals: float
) -> Comparison:
    error = (got - ref).abs().amax(dim=-1)
    kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    top2 = ref.topk(2, dim=-1).values
    prefill = ((got_prompt - ref_prompt).abs().amax() / ref_prompt.abs().amax()).item()
    return Comparison(
        error / ref.abs().amax(dim=-1),
        kl.clamp(min=0),
        got.argmax(-1) == ref.argmax(-1),
        (top2[:, 0] - top2[:, 1]) < error,
        prefill,
        subnormals,
    )


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
