"""How much a float8 KV cache changes the model's output, against the same model's float32 cache.

    python -m bench.fp8_kv_accuracy [--new-tokens 1024] [--prompt-tokens 64] [--device cpu]

For each of the parity tests' model shapes (tests/model/test_parity.py: GQA 1, 2 and 4, head_dim
64 and 128, and two Qwen3-MoE shapes; random weights at 15x transformers' init scale, so that
greedy continuations wander), a float32 model generates greedily with a float32 cache. The same token sequence is
then fed through the float8 cache (teacher forcing: the prompt as one prefill, then one decode
step per token) with each way of choosing the scales:
- per-tensor: one scale per layer for K and one for V (the largest kv head's bound);
- per-head: one scale per kv head (worker/model/kv_scales.py's bounds);
- unit: scale 1 everywhere (what vLLM uses without calibrated scales).
Per position it compares the logits with the float32 cache's: the largest error relative to the
logits' scale, the KL divergence of the two next-token distributions, and whether the argmax
agrees. A disagreement is counted as a near-tie when the float32 cache's top two logits are
closer than that position's largest logit error: either answer is then within the float8 noise.
It also counts the stored values that fall below e4m3's normal range (subnormal or zero),
where a scale too coarse for a head would cost it precision. Last, the float8 cache with the
engine's scales (per-head) generates on its own, without teacher forcing: the table gives the
token at which it first leaves the float32 cache's greedy sequence.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm

from harness.kv_accuracy import PAGE_SIZE, compare, first_divergence, greedy, teacher_forced_fp8
from harness.model_configs import CONFIGS
from kernels.fp8 import FP8_DTYPE
from worker.model.kv_scales import fp8_kv_scales_per_head
from worker.model.loader import load_model
from worker.model.presets import write_random_checkpoint

VOCAB = 2048


def build_model(name: str, max_positions: int, device: str, directory: Path):
    config = {
        **CONFIGS[name],
        "vocab_size": VOCAB,
        "max_position_embeddings": max_positions,
        "initializer_range": 0.3,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    ckpt = write_random_checkpoint(directory / name, config, seed=7, norm_std=0.1)
    return load_model(ckpt, dtype=torch.float32, device=device).model


def set_scales(model, how: str) -> None:
    for layer in model.model.layers:
        k_scale, v_scale = fp8_kv_scales_per_head(layer, 1.0)
        if how == "per-tensor":
            k_scale, v_scale = k_scale.amax().expand_as(k_scale), v_scale.amax().expand_as(v_scale)
        elif how == "unit":
            k_scale, v_scale = torch.ones_like(k_scale), torch.ones_like(v_scale)
        layer.self_attn.k_scale.copy_(k_scale)
        layer.self_attn.v_scale.copy_(v_scale)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS), choices=list(CONFIGS))
    args = parser.parse_args()
    prompt = torch.randint(0, VOCAB, (args.prompt_tokens,), generator=torch.Generator().manual_seed(3)).tolist()
    rows, divergences = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in tqdm(args.configs, desc="configs"):
            model = build_model(name, args.prompt_tokens + args.new_tokens + PAGE_SIZE, args.device, Path(tmp))
            tokens, ref_prompt, ref = greedy(model, prompt, args.new_tokens)
            for how in ("per-tensor", "unit", "per-head"):
                set_scales(model, how)
                rows.append((name, how, compare(ref_prompt, ref, *teacher_forced_fp8(model, prompt, tokens))))
            own, _, _ = greedy(model, prompt, args.new_tokens, FP8_DTYPE)
            divergences[name] = first_divergence(tokens, own)
    print(
        f"\n{args.prompt_tokens}-token prompt, {args.new_tokens} generated tokens per config, device {args.device}, "
        f"torch {torch.__version__}\n"
    )
    print(
        "| config | scales | prefill max rel error | decode max / mean rel error | KL max / mean (nats) | "
        "argmax agreement | disagreements that are near-ties | stored values below normal |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, how, c in rows:
        disagree = ~c.agree
        print(
            f"| {name} | {how} | {c.prefill_rel_error:.2e} | {c.rel_error.max():.2e} / {c.rel_error.mean():.2e} | "
            f"{c.kl.max():.2e} / {c.kl.mean():.2e} | {int(c.agree.sum())}/{len(c.agree)} "
            f"({c.agree.float().mean():.2%}) | {int((disagree & c.near_tie).sum())} of {int(disagree.sum())} | "
            f"{c.subnormal_share:.3%} |"
        )
    print(
        "\nThe float8 cache (per-head scales) generating on its own leaves the float32 cache's greedy tokens at: "
        + ", ".join(f"{name} {'never' if i is None else f'token {i}'}" for name, i in divergences.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
