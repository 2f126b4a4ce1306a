"""Speculative decoding over tensor parallelism: a verify step is the ranks' extend step (its
host arrays through the step ring, every token sampling), and the draft model or EAGLE-3 head
runs on rank 0 alone, where the hidden states an EAGLE-3 head reads are whole. Two ranks with
speculation generate what one rank generates without it."""

import pytest

from harness.model_configs import SMALL_DENSE
from producer_client.schema import SamplingParams
from tests.engine.speculative_support import always_speculating
from tests.engine.test_engine import random_prompts
from tests.engine.test_speculative import assert_same_outputs
from tests.engine.test_tensor_parallel import DEVICE, ENGINE
from worker.engine import Engine
from worker.model.eagle3_checkpoint import write_random_eagle3_head
from worker.model.presets import qwen3_config

PROMPTS = random_prompts(5, 3, 40, seed=51)
GREEDY = SamplingParams(temperature=0, max_tokens=14)
PARAMS = [GREEDY, SamplingParams(temperature=0.9, seed=8, max_tokens=14)] * 2 + [GREEDY]


def two_ranks(path, **settings) -> Engine:
    return Engine.from_pretrained(path, device=DEVICE, dtype="float32", tensor_parallel_size=2, **ENGINE, **settings)


@pytest.mark.slow
def test_two_ranks_with_a_draft_model_generate_what_one_rank_does_without(checkpoint):
    single = Engine.from_pretrained(checkpoint, device=DEVICE, dtype="float32", **ENGINE)
    greedy, mixed = single.generate(PROMPTS, GREEDY), single.generate(PROMPTS, PARAMS)
    with two_ranks(checkpoint, speculative_method="draft", speculative_model=str(checkpoint)) as tp:
        always_speculating(tp)
        assert_same_outputs(tp.generate(PROMPTS, GREEDY), greedy)
        stats = tp.stats()
        assert_same_outputs(tp.generate(PROMPTS, PARAMS), mixed)
    assert stats.accepted_draft_tokens > 0.9 * stats.draft_tokens  # greedy, the model drafting for itself


@pytest.mark.slow
def test_two_ranks_with_an_eagle3_head_generate_what_one_rank_does_without(checkpoint, tmp_path):
    want = Engine.from_pretrained(checkpoint, device=DEVICE, dtype="float32", **ENGINE).generate(PROMPTS, PARAMS)
    # The head has an embedding of its own: rank 0 holds only its share of the model's.
    own = write_random_eagle3_head(
        tmp_path / "own", qwen3_config(**SMALL_DENSE), aux_layer_ids=[0, 0, 1], own_embedding=True
    )
    with two_ranks(checkpoint, speculative_method="eagle3", speculative_model=str(own), overlap_schedule=True) as tp:
        always_speculating(tp)
        assert_same_outputs(tp.generate(PROMPTS, PARAMS), want)
        assert tp.stats().draft_tokens > 0
