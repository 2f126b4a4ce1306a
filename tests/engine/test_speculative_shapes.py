"""Speculative decoding is lossless on every shape of model the engine serves: the tiny and
tiny-moe presets (Qwen3's whole vocabulary, tied heads; tiny-moe's routing renormalized) and the
test checkpoints of other shapes: an untied head with 2 query heads per KV head (conftest's
SMALL_DENSE), one KV head for 4 query heads and an odd vocabulary, a mixture of experts whose routing is
not renormalized beside a dense layer. On each, greedy, seeded and penalized outputs equal the
engine's without speculation token for token, with drafts wrong at every fifth position (so
verification rejects at every depth) and with the model drafting for itself through the
draft-model proposer (its KV in the pool's pages, over that shape)."""

import pytest
import torch

from producer_client.schema import SamplingParams
from tests.engine.speculative_support import always_speculating, known_outputs, speculative
from tests.engine.support import VOCAB, engine_maker
from tests.engine.test_engine import assert_all_pages_free_after_clear, random_prompts
from tests.engine.test_speculative import PATTERNS, assert_same_outputs
from worker.model.loader import load_model
from worker.model.presets import resolve_model_path
from worker.model.tokenizer import Tokenizer

# Below every shape's vocabulary (the replicated-KV checkpoint's is VOCAB - 1).
PROMPTS = [[t % (VOCAB - 1) for t in p] for p in random_prompts(4, 1, 24, seed=45)]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=40, seed=8, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
]
# Shape -> the session fixture holding its checkpoint, or the preset's name.
SHAPES = {
    "tiny": "tiny",
    "tiny-moe": "tiny-moe",
    "untied-gqa-2": "checkpoint",
    "one-kv-head-odd-vocab": "replicated_kv_checkpoint",
    "moe-unnormalized-with-dense-layer": "moe_checkpoint",
}


@pytest.fixture(scope="module", params=SHAPES)
def shape(request):
    """(checkpoint path, engine maker) of the model of that shape, loaded once for the module."""
    source = SHAPES[request.param]
    path = resolve_model_path(source) if source in ("tiny", "tiny-moe") else request.getfixturevalue(source)
    loaded = load_model(path, dtype=torch.float32), Tokenizer.from_dir(path)
    return path, engine_maker(loaded)


def test_drafts_rejected_at_every_depth_change_no_output(shape):
    _, make = shape
    want, known = known_outputs(make(), PROMPTS, PARAMS)
    vocab = make().vocab_size
    engine = speculative(make, known, vocab, PATTERNS["fifth-wrong"])
    assert_same_outputs(engine.generate(PROMPTS, PARAMS), want)
    stats = engine.stats()
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens
    assert_all_pages_free_after_clear(engine)


def test_the_model_drafting_for_itself_changes_no_output_and_is_accepted(shape):
    path, make = shape
    want = make().generate(PROMPTS, PARAMS)
    engine = always_speculating(make(speculative_method="draft", speculative_model=str(path)))
    assert_same_outputs(engine.generate(PROMPTS, PARAMS), want)
    # Greedy requests alone: each draft is the model's own choice (seeded and penalized requests
    # take a greedy draft only as often as their draw or penalty agrees).
    before = engine.stats()
    greedy = [PARAMS[0]] * len(PROMPTS)
    assert_same_outputs(engine.generate(PROMPTS, greedy), make().generate(PROMPTS, greedy))
    after = engine.stats()
    drafted = after.draft_tokens - before.draft_tokens
    assert after.accepted_draft_tokens - before.accepted_draft_tokens > 0.97 * drafted > 0
    assert_all_pages_free_after_clear(engine)
