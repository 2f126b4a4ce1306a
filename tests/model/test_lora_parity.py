"""LoRA adapters on our Qwen3 against transformers with peft's adapters, on the same random
checkpoints and adapters (PEFT's layout, worker/model/random_adapter.py), in fp32: one batch mixes
the base model and three adapters of ranks 8, 16 and 64 (one with rsLoRA, one with rank_pattern
and alpha_pattern), the same prompt under several of them. Shapes: tiny's, tiny-moe's (its experts
take no adapter: attention only) and one no preset has (odd head counts and sizes).

Each prompt's logits must match peft's within float32 rounding (relative error as in
test_parity.py), and the batch's greedy continuations peft's generate token for token.
"""

import pytest
import torch

from harness.paged_model import PagedModelRunner
from tests.model.test_parity import assert_logits_close
from worker.engine.lora.adapters import AdapterHandle
from worker.engine.lora.rows import LoraRows
from worker.engine.lora.slots import DeviceSlots
from worker.model.loader import load_model
from worker.model.lora import attach_lora
from worker.model.lora_adapter import read_adapter
from worker.model.presets import PRESETS, qwen3_config, write_random_checkpoint
from worker.model.random_adapter import write_random_adapter

VOCAB = 2048
MAX_RANK = 64
CONFIGS = {
    "tiny": PRESETS["tiny"].config,
    "tiny-moe": PRESETS["tiny-moe"].config,
    "hidden": qwen3_config(
        hidden_size=96,
        intermediate_size=200,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=48,
        tie_word_embeddings=False,
    ),
}
# name -> write_random_adapter's arguments
ADAPTERS = {
    "r8-all": {"rank": 8, "seed": 11},
    "r16-qv-rslora": {"rank": 16, "target_modules": ("q_proj", "v_proj"), "use_rslora": True, "seed": 12},
    "r64-patterns": {
        "rank": 64,
        "target_modules": ("k_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        "rank_pattern": {"down_proj": 32, "model.layers.1.self_attn.k_proj": 12},
        "alpha_pattern": {"o_proj": 24.0},
        "seed": 13,
    },
}
# (prompt index, adapter or None): the batch's sequences; prompt 0 runs under all four.
BATCH = [
    (0, None),
    (0, "r8-all"),
    (0, "r16-qv-rslora"),
    (0, "r64-patterns"),
    (1, "r8-all"),
    (2, None),
    (3, "r64-patterns"),
]
PROMPT_LENS = (9, 1, 23, 40)


@pytest.fixture(scope="module", params=list(CONFIGS))
def setup(request, tmp_path_factory):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    config = {
        **CONFIGS[request.param],
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "initializer_range": 0.3,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    ckpt = write_random_checkpoint(root / "base", config, seed=5, norm_std=0.1)
    paths = {name: write_random_adapter(root / name, config, **args) for name, args in ADAPTERS.items()}
    model = load_model(ckpt, dtype=torch.float32).model
    targets = attach_lora(model, len(ADAPTERS), MAX_RANK)
    slots = DeviceSlots(targets, len(ADAPTERS))
    slot_of = {}
    for slot, (name, path) in enumerate(paths.items()):
        slots.install(slot, AdapterHandle(name, path), read_adapter(name, path, targets, MAX_RANK, torch.float32))
        slot_of[name] = slot
    refs = {None: AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()}
    for name, path in paths.items():
        base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
        refs[name] = PeftModel.from_pretrained(base, path).eval()
    return model, slot_of, refs


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def lora_batch(seqs: list[int], new_tokens: list[int], slot_of: dict, adapters: list):
    slots = torch.tensor([-1 if a is None else slot_of[a] for a in adapters]).numpy()
    rows = LoraRows.of(slots[seqs], torch.tensor(new_tokens).numpy(), len(slot_of))
    return rows.to_device(torch.device("cpu"))


def test_mixed_batch_prefill_logits_match_peft(setup, prompts):
    model, slot_of, refs = setup
    runner = PagedModelRunner(model)
    seqs = [runner.add_sequence() for _ in BATCH]
    adapters = [a for _, a in BATCH]
    chunks = {s: prompts[p] for s, (p, _) in zip(seqs, BATCH)}
    logits = runner.extend(chunks, lora_batch(seqs, [len(c) for c in chunks.values()], slot_of, adapters))
    for (p, adapter), got in zip(BATCH, logits):
        with torch.inference_mode():
            expected = refs[adapter](torch.tensor([prompts[p]])).logits[0].float()
        assert_logits_close(got, expected)


def test_mixed_batch_greedy_continuations_match_peft_generate(setup, prompts):
    model, slot_of, refs = setup
    new_tokens = 16
    runner = PagedModelRunner(model)
    seqs = [runner.add_sequence() for _ in BATCH]
    adapters = [a for _, a in BATCH]
    chunks = {s: prompts[p] for s, (p, _) in zip(seqs, BATCH)}
    first = runner.extend(chunks, lora_batch(seqs, [len(c) for c in chunks.values()], slot_of, adapters))
    last = [logits[-1].argmax().item() for logits in first]
    generated = [[t] for t in last]
    decode_lora = lora_batch(seqs, [1] * len(seqs), slot_of, adapters)
    for _ in range(new_tokens - 1):
        last = runner.decode(dict(zip(seqs, last)), decode_lora).argmax(-1).tolist()
        for out, t in zip(generated, last):
            out.append(t)
    for (p, adapter), out in zip(BATCH, generated):
        with torch.inference_mode():
            expected = (
                refs[adapter]
                .generate(
                    input_ids=torch.tensor([prompts[p]]),
                    attention_mask=torch.ones(1, len(prompts[p]), dtype=torch.long),
                    max_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )[0, len(prompts[p]) :]
                .tolist()
            )
        assert out == expected, (p, adapter)
    # Every adapter changes what prompt 0 continues with: the adapters were applied, not skipped.
    under = {adapter: out for (p, adapter), out in zip(BATCH, generated) if p == 0}
    assert len({tuple(out) for out in under.values()}) == len(under)
