"""The draft-model proposer: a smaller Qwen3 of the same vocabulary drafts, with its own KV in the
pool's pages; outputs stay those of the engine without speculation. With the model itself as its
own draft every drafted token is the target's choice, so its acceptance shows that the draft's KV
(caught up after admission, preemption and rejected drafts) holds the request's own tokens."""

import pytest
import torch

from harness.model_configs import SMALL_DENSE
from producer_client.errors import InvalidArgument
from producer_client.schema import SamplingParams
from tests.engine.speculative_support import always_speculating
from tests.engine.support import write_test_checkpoint
from tests.engine.test_engine import assert_all_pages_free_after_clear, random_prompts
from tests.engine.test_speculative import assert_same_outputs
from worker.engine.kv_pool import KVCacheShape
from worker.model.presets import qwen3_config

PROMPTS = random_prompts(6, 1, 40, seed=31)
GREEDY = SamplingParams(temperature=0, max_tokens=24)


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """Another random model of the test vocabulary: one layer, narrower, tied, 4 q heads per kv head."""
    shape = {**SMALL_DENSE, "hidden_size": 32, "num_hidden_layers": 1, "num_key_value_heads": 1, "head_dim": 16}
    return write_test_checkpoint(
        tmp_path_factory.mktemp("draft"), qwen3_config(**shape | {"tie_word_embeddings": True}), 9
    )


def acceptance(engine) -> float:
    stats = engine.stats()
    return stats.accepted_draft_tokens / stats.draft_tokens


@pytest.mark.parametrize(
    "settings",
    [{}, {"num_pages": 24}, {"max_num_batched_tokens": 24, "max_running": 8}, {"kv_cache_dtype": "fp8_e4m3"}],
    ids=["roomy", "preemption", "small-budget", "fp8-kv"],
)
def test_the_model_drafting_for_itself_is_accepted_throughout(make_engine, checkpoint, settings):
    want = make_engine(**settings).generate(PROMPTS, GREEDY)
    engine = always_speculating(make_engine(speculative_method="draft", speculative_model=str(checkpoint), **settings))
    assert_same_outputs(engine.generate(PROMPTS, GREEDY), want)
    assert acceptance(engine) > 0.97
    if "num_pages" in settings:
        assert engine.stats().preemptions > 0
    assert_all_pages_free_after_clear(engine)


def test_a_smaller_draft_changes_no_output_greedy_or_seeded(make_engine, small_draft):
    params = [GREEDY, SamplingParams(temperature=0.8, top_k=30, seed=5, max_tokens=24)] * 3
    want = make_engine().generate(PROMPTS, params)
    engine = always_speculating(
        make_engine(speculative_method="draft", speculative_model=str(small_draft), num_speculative_tokens=3)
    )
    assert_same_outputs(engine.generate(PROMPTS, params), want)
    assert engine.stats().draft_tokens > 0


def test_tiny_drafts_for_tiny_by_preset_name(make_tiny_engine):
    prompts = [[11, 12, 13, 14, 15] * 3, [21, 22, 23, 24]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = make_tiny_engine().generate(prompts, params)
    engine = always_speculating(make_tiny_engine(speculative_method="draft", speculative_model="tiny"))
    assert_same_outputs(engine.generate(prompts, params), want)
    assert acceptance(engine) > 0.97


def test_a_draft_of_another_vocabulary_is_refused(make_engine):
    with pytest.raises(InvalidArgument, match="speculative_model.*vocabulary"):
        make_engine(speculative_method="draft", speculative_model="tiny")


def test_each_page_of_the_pool_is_sized_for_the_draft_too(make_engine, checkpoint, small_draft):
    plain = make_engine(num_pages=None, kv_cache_mib=1)
    drafting = make_engine(
        num_pages=None, kv_cache_mib=1, speculative_method="draft", speculative_model=str(small_draft)
    )
    target = KVCacheShape(
        SMALL_DENSE["num_hidden_layers"], SMALL_DENSE["num_key_value_heads"], SMALL_DENSE["head_dim"], 4, torch.float32
    )
    draft = KVCacheShape(1, 1, 16, 4, torch.float32)
    assert plain.allocator.num_pages == 2**20 // target.bytes_per_page
    assert drafting.allocator.num_pages == 2**20 // (target.bytes_per_page + draft.bytes_per_page)
