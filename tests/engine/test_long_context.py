"""32,768 tokens through the engine, equal to transformers.

A 30,720-token prompt is prefilled in chunks of max_num_batched_tokens into paged KV and
2,048 tokens are decoded after it, to a context of 32,768; then those 32,768 tokens come back
as one prompt, which the radix cache already holds but for its last page. transformers runs
the same 32,768 tokens once: its logits at every generated position are compared with the
engine's, and its argmax at each must be the token the engine chose. Since each position's
context is the engine's own tokens so far, agreement everywhere means transformers' greedy
generation from the prompt is the same sequence (by induction), without a second, slower run.

The model has the `tiny` preset's shape (4 layers, 4 q and 2 kv heads of 64, hidden 128), drawn
at 15x the usual weight scale so that greedy tokens wander (at the preset's own scale a random
model repeats one token), with its vocabulary cut to Qwen3's first VOCAB ids as in
tests/model/test_parity.py: what is long here is the context (positions, pages, chunks, the radix
cache), not the LM head, whose 151,936 rows cost each decode step and each compared position
time that proved nothing more (bench/RESULTS.md).

The same runs at 4,608 tokens (a 4,352-token prompt in two chunks, 256 generated): the GPU
acceptance's CPU rehearsal (scripts/acceptance/stages/long_context.py, `-k 4k`), a minute
where the 32K run takes several.

Memory: the engine's for the request, its KV pool (sized to the request) and the peak of what
the request's steps allocate beyond it, stays within MEMORY_MULTIPLE times the request's KV
bytes; an attention buffer quadratic in the context (4 GiB of float32 scores at 32K) would
break it. numba's compiler and the tokenizer's tables, loaded once per process by warm-up,
are not the request's.

On CUDA the same runs on the GPU (decode graphs off: their replays skip the hook that records
each step's hidden state; tests/engine/test_cuda_graph.py proves them equal to eager steps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch

from harness.peak_memory import peak_memory
from producer_client.schema import SamplingParams
from worker.engine import Engine, EngineSettings
from worker.engine.kv_pool import KVCacheShape, pages_for
from worker.model.loader import load_model
from worker.model.presets import PRESETS, write_random_checkpoint
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files
from worker.model.tokenizer import Tokenizer

# bench/RESULTS.md has its CPU time; the timeout leaves room for a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.cuda]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
PAGE_SIZE = 16
REL_TOL = 1e-4  # as tests/model/test_parity.py
# The engine's memory for the request (KV pool, activations, attention temporaries, logits)
# over the request's KV bytes; bench/RESULTS.md has what it measured. The steps' part is a
# chunk's activations and one layer's gathered context, so the multiple falls as contexts and
# layers grow: this shape, 4 layers, is a small model's worst case.
MEMORY_MULTIPLE = 2.0
VOCAB = 2048


@dataclass(frozen=True)
class Lengths:
    prompt: int
    generated: int

    @property
    def total(self) -> int:
        return self.prompt + self.generated


FULL = Lengths(30_720, 2_048)  # 32,768
SHORT = Lengths(4_352, 256)  # past one 4,096-token chunk
# 32K first: its memory is measured in a process that has run nothing long before.
LENGTHS = pytest.mark.parametrize("engine_run", [FULL, SHORT], ids=["32k", "4k"], indirect=True)


@dataclass
class EngineRun:
    lengths: Lengths
    prompt: list[int]
    generated: list[int]
    hidden: torch.Tensor  # [generated, hidden]: the state each generated token was sampled from
    full_prompt_token: int  # the token sampled after all the tokens given as one prompt
    full_prompt_hidden: torch.Tensor  # [1, hidden]
    cached_tokens: int  # of that prompt, found in the radix cache
    model: torch.nn.Module  # the engine's, whose LM head turns the hidden states into logits
    kv_bytes: int  # of the request's computed tokens (all but the last)
    peak_bytes: int  # its KV pool (sized to it) and, at their peak, the allocations of its steps
    seconds: dict[str, float] = field(default_factory=dict)


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    config = {
        **PRESETS["tiny"].config,
        "vocab_size": VOCAB,
        "initializer_range": 0.3,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    ckpt = write_random_checkpoint(tmp_path_factory.mktemp("long_context"), config, seed=5, norm_std=0.1)
    write_qwen3_tokenizer_files(ckpt)
    return ckpt


def record_hidden(engine: Engine) -> list[torch.Tensor]:
    """Every row the engine computes logits from, in order, kept on the host."""
    rows: list[torch.Tensor] = []
    compute_logits = engine.runner.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.detach().to("cpu", copy=True))
        return compute_logits(hidden)

    engine.runner.compute_logits = recording
    return rows


@pytest.fixture(scope="module")
def engine_run(request, long_checkpoint) -> EngineRun:
    """Runs before transformers does, so that its memory cannot hide the engine's."""
    lengths: Lengths = request.param
    total = lengths.total
    prompt = torch.randint(0, VOCAB, (lengths.prompt,), generator=torch.Generator().manual_seed(11)).tolist()
    loaded = load_model(long_checkpoint, dtype=torch.float32, device=DEVICE)
    settings = EngineSettings(
        num_pages=pages_for(total + PAGE_SIZE, PAGE_SIZE),
        page_size=PAGE_SIZE,
        max_running=1,
        max_model_len=total + 1,
        cuda_graphs=False,
    )
    engine = Engine(loaded.model, loaded.config, Tokenizer.from_dir(long_checkpoint), settings, [], DEVICE)
    engine.warm_up()
    # Structured outputs' vocabulary tables are built on the compile thread while warm-up goes on
    # (about 100 MiB in passing): once per process, not the request's, so not in its peak.
    engine.grammars.prepare().result()
    hidden = record_hidden(engine)
    memory, seconds = {}, {}
    with peak_memory(DEVICE, memory):
        start = time.process_time()
        out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=lengths.generated, ignore_eos=True))[0]
        seconds[f"{lengths.prompt:,}-token prompt + {lengths.generated:,} generated, engine CPU"] = (
            time.process_time() - start
        )
    generated_rows = torch.cat(hidden)
    hidden.clear()
    start = time.process_time()
    again = engine.generate([prompt + out.token_ids], SamplingParams(temperature=0, max_tokens=1))[0]
    seconds[f"{total:,}-token prompt from the radix cache, engine CPU"] = time.process_time() - start
    config = loaded.config
    shape = KVCacheShape(
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.head_dim,
        PAGE_SIZE,
        engine.runner.kv_caches[0][0].dtype,
    )
    pool_bytes = engine.allocator.num_pages * shape.bytes_per_page  # allocated (and zeroed) before the request
    return EngineRun(
        lengths,
        prompt,
        out.token_ids,
        generated_rows,
        again.token_ids[0],
        torch.cat(hidden),
        again.usage.cached_prompt_tokens,
        loaded.model,
        (total - 1) * shape.bytes_per_token,
        pool_bytes + memory["bytes"],
        seconds,
    )


@pytest.fixture(scope="module")
def reference(engine_run, long_checkpoint):
    """transformers over all the tokens: (its final hidden states at the last generated + 1
    positions, its LM head)."""
    from transformers import Qwen3ForCausalLM as HFQwen3ForCausalLM

    hf = HFQwen3ForCausalLM.from_pretrained(long_checkpoint, dtype=torch.float32).to(DEVICE).eval()
    ids = torch.tensor([engine_run.prompt + engine_run.generated], device=DEVICE)
    start = time.process_time()
    with torch.inference_mode():
        last = hf.model(ids).last_hidden_state[0, engine_run.lengths.prompt - 1 :]
    engine_run.seconds[f"{len(ids[0]):,}-token prompt, transformers CPU"] = time.process_time() - start
    return last, hf.lm_head


@torch.inference_mode()
def compare_logits(
    ours_hidden: torch.Tensor, ref_hidden: torch.Tensor, lm_head, engine_lm_head
) -> tuple[float, torch.Tensor]:
    """(worst per-position relative logit error, transformers' argmax per position), in blocks, which
    keep the comparison's memory bounded whatever the vocabulary."""
    worst, argmax = 0.0, []
    for start in range(0, ref_hidden.shape[0], 256):
        ref = lm_head(ref_hidden[start : start + 256]).float().cpu()
        ours = engine_lm_head(ours_hidden[start : start + 256].to(DEVICE)).float().cpu()
        rel = (ours - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)
        worst = max(worst, rel.max().item())
        argmax.append(ref.argmax(dim=-1))
    return worst, torch.cat(argmax)


@LENGTHS
def test_long_prompt_and_generated_tokens_match_transformers(engine_run, reference):
    ref_hidden, lm_head = reference
    generated = engine_run.lengths.generated
    worst, hf_choice = compare_logits(
        engine_run.hidden, ref_hidden[:generated], lm_head, engine_run.model.compute_logits
    )
    print(
        f"\n{engine_run.lengths.total:,}-token parity: worst per-position relative logit error {worst:.2e} "
        f"over {generated:,} positions; " + "; ".join(f"{k} {v:.1f} s" for k, v in engine_run.seconds.items())
    )
    assert worst <= REL_TOL
    assert engine_run.generated == hf_choice.tolist()  # transformers' greedy continuation, token for token
    assert len(set(engine_run.generated)) > generated // 10  # a continuation that wanders, not one token repeated


@LENGTHS
def test_whole_prompt_from_the_radix_cache_matches_transformers(engine_run, reference):
    ref_hidden, lm_head = reference
    # All but the last page: 32,752 of 32,768.
    assert engine_run.cached_tokens == (engine_run.lengths.total - 1) // PAGE_SIZE * PAGE_SIZE
    worst, hf_choice = compare_logits(
        engine_run.full_prompt_hidden,
        ref_hidden[engine_run.lengths.generated :],
        lm_head,
        engine_run.model.compute_logits,
    )
    assert worst <= REL_TOL
    assert engine_run.full_prompt_token == hf_choice.item()


@pytest.mark.parametrize("engine_run", [FULL], ids=["32k"], indirect=True)
def test_32k_request_memory_stays_within_a_small_multiple_of_its_kv(engine_run):
    multiple = engine_run.peak_bytes / engine_run.kv_bytes
    print(
        f"\n32K memory: the KV pool and the steps' peak {engine_run.peak_bytes / 2**20:.0f} MiB, "
        f"KV {engine_run.kv_bytes / 2**20:.0f} MiB: {multiple:.2f}x"
    )
    assert engine_run.kv_bytes == (FULL.total - 1) * 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 kv heads of 64, fp32
    assert multiple <= MEMORY_MULTIPLE
