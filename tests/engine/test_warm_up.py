"""Engine.warm_up: it runs at every page size, and leaves the engine generating what a cold one does."""
import pytest

from producer_client.schema import SamplingParams
from tests.engine.test_engine import random_prompts, token_ids

GREEDY = SamplingParams(temperature=0, max_tokens=10)


@pytest.mark.parametrize("page_size", [1, 2])
def test_an_engine_with_tiny_pages_warms_up_and_generates_what_page_size_16_does(make_engine, page_size):
    prompts = random_prompts(5, 1, 40, seed=21)
    expected = token_ids(make_engine(page_size=16).generate(prompts, GREEDY))
    engine = make_engine(page_size=page_size, num_pages=2048 // page_size)
    engine.warm_up()
    assert engine.allocator.num_free == engine.allocator.num_pages
    assert token_ids(engine.generate(prompts, GREEDY)) == expected
