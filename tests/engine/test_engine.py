"""The engine over a real (tiny, random) Qwen3 against transformers and against itself."""

import random

import pytest

from producer_client.errors import InvalidArgument
from producer_client.schema import SamplingParams
from tests.engine.support import VOCAB
from worker.engine.errors import PromptTooLong

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def assert_all_pages_free_after_clear(engine) -> None:
    assert not engine.has_unfinished()
    engine.cache.clear()
    assert engine.allocator.num_free == engine.allocator.num_pages


def test_sixteen_mixed_prompts_batched_match_transformers_one_by_one(make_engine, hf_greedy):
    prompts = random_prompts(16, 1, 70)
    engine = make_engine()
    outputs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(prompt, GREEDY.max_tokens)
        assert out.finish_reason == "length"
        assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == 12
    assert_all_pages_free_after_clear(engine)


def test_shared_system_prompt_hits_the_prefix_cache_and_changes_no_output(make_engine):
    system = random_prompts(1, 60, 60, seed=1)[0]
    prompts = [system + tail for tail in random_prompts(8, 3, 20, seed=2)]
    off = make_engine(enable_prefix_cache=False)
    on = make_engine()
    # One request first so the prefix is cached before the rest arrive together.
    expected = token_ids(off.generate(prompts, GREEDY))
    assert token_ids(on.generate(prompts[:1], GREEDY) + on.generate(prompts[1:], GREEDY)) == expected

    stats = on.stats()
    assert stats.cache_hit_tokens == 7 * 60  # 60 is a whole number of 4-token pages
    assert stats.cache_queried_tokens == sum(len(p) for p in prompts)
    assert stats.computed_prompt_tokens == sum(len(p) for p in prompts) - 7 * 60
    assert off.stats().computed_prompt_tokens == sum(len(p) for p in prompts)
    assert off.stats().cache_hit_tokens == 0
    # Finished requests left their whole prompts cached: a rerun hits every whole page but the
    # one holding the last prompt token, which must run to be sampled from.
    rerun = on.generate(prompts[:2], GREEDY)
    assert [o.usage.cached_prompt_tokens for o in rerun] == [(len(p) - 1) // 4 * 4 for p in prompts[:2]]
    assert token_ids(rerun) == expected[:2]


@pytest.mark.slow
def test_a_pool_too_small_for_the_load_preempts_and_changes_no_output(make_engine):
    prompts = random_prompts(12, 10, 40, seed=3)
    params = SamplingParams(temperature=0, max_tokens=24)
    expected = token_ids(make_engine().generate(prompts, params))
    tight = make_engine(num_pages=24)  # 96 token slots for up to 12 x 64
    assert token_ids(tight.generate(prompts, params)) == expected
    assert tight.stats().preemptions > 0
    assert_all_pages_free_after_clear(tight)


def test_chunked_prefill_with_a_tiny_budget_changes_no_output(make_engine):
    prompts = random_prompts(6, 20, 60, seed=4)
    expected = token_ids(make_engine().generate(prompts, GREEDY))
    chunked = make_engine(max_num_batched_tokens=7, max_running=4)
    assert token_ids(chunked.generate(prompts, GREEDY)) == expected
    assert chunked.stats().steps > sum(len(p) for p in prompts) // 7


def test_seeded_sampling_repeats_across_batch_compositions(make_engine):
    prompts = random_prompts(5, 5, 30, seed=5)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16)
    alone = make_engine().generate([prompts[0]], seeded)[0].token_ids
    crowd = [SamplingParams(temperature=1.0, max_tokens=16)] * 4
    mixed = make_engine().generate(prompts[1:3] + [prompts[0]] + prompts[3:], crowd[:2] + [seeded] + crowd[2:])
    assert mixed[2].token_ids == alone
    other_seed = make_engine().generate([prompts[0]], seeded.model_copy(update={"seed": 43}))[0].token_ids
    assert other_seed != alone


def test_abort_mid_generation_frees_the_requests_pages(make_engine):
    engine = make_engine()
    free_before = engine.allocator.num_free
    engine.add_request("a", random_prompts(1, 30, 30, seed=6)[0], SamplingParams(temperature=0, max_tokens=100))
    engine.add_request("b", random_prompts(1, 9, 9, seed=7)[0], SamplingParams(temperature=0, max_tokens=3))
    for _ in range(4):
        engine.step()
    assert engine.allocator.num_used > 0
    assert engine.abort("a")
    assert not engine.abort("a")
    (final,) = [o for o in engine.step() if o.request_id == "a"]
    assert final.finished and final.finish_reason == "abort" and final.usage.completion_tokens == 4
    while engine.has_unfinished():
        engine.step()
    # Only the prefix cache still holds pages, and only unlocked ones.
    assert engine.allocator.num_used == engine.cache.evictable_pages == engine.cache.cached_pages()
    engine.cache.clear()
    assert engine.allocator.num_free == free_before


def test_request_too_large_for_the_pool_fails_and_does_not_block_others(make_engine):
    engine = make_engine(num_pages=8)  # 32 tokens
    prompts = random_prompts(3, 6, 10, seed=8)
    big = random_prompts(1, 40, 40, seed=9)[0]
    outs = engine.generate([prompts[0], big, *prompts[1:]], SamplingParams(temperature=0, max_tokens=4))
    assert [o.finish_reason for o in outs] == ["length", "error", "length", "length"]
    assert outs[1].error.code == "kv_capacity_exceeded"
    assert "40 tokens" in outs[1].error.message
    assert outs[1].token_ids == []
    assert_all_pages_free_after_clear(engine)


def test_bad_requests_raise_typed_errors_naming_the_field(make_engine):
    engine = make_engine(max_model_len=64)
    ok = SamplingParams(max_tokens=4)
    cases = [
        (dict(prompt_token_ids=[]), InvalidArgument, "prompt_token_ids"),
        (dict(prompt_token_ids=[1, VOCAB]), InvalidArgument, "prompt_token_ids"),
        (dict(prompt_token_ids=[-1]), InvalidArgument, "prompt_token_ids"),
        (dict(prompt_token_ids=[1] * 64), PromptTooLong, "prompt_token_ids"),
        (dict(params=SamplingParams(stop_token_ids=[VOCAB])), InvalidArgument, "stop_token_ids"),
        (dict(params=SamplingParams(max_tokens=2, min_tokens=3)), InvalidArgument, "min_tokens"),
    ]
    for kwargs, error, field in cases:
        args = {"request_id": "x", "prompt_token_ids": [1, 2], "params": ok, **kwargs}
        with pytest.raises(error) as e:
            engine.add_request(**args)
        assert e.value.field == field
    assert PromptTooLong("f", "m").code == "prompt_too_long"
    engine.add_request("x", [1] * 63, ok)
    with pytest.raises(InvalidArgument, match="request_id"):
        engine.add_request("x", [1, 2], ok)
    (out,) = [o for o in iter_until_done(engine) if o.finished]
    assert out.finish_reason == "length" and out.usage.completion_tokens == 1  # max_model_len stops it


def test_capacity_reports_free_slots_and_unpromised_pages(make_engine):
    engine = make_engine(num_pages=32, max_running=4)
    assert engine.capacity().free_slots == 4 and engine.capacity().free_pages == 32
    engine.add_request("a", list(range(10)), SamplingParams(max_tokens=8))
    cap = engine.capacity()
    assert (cap.free_slots, cap.free_pages, cap.page_size) == (3, 29, 4)  # waiting: 3 pages promised
    engine.step()
    assert engine.capacity().free_pages == 29  # 10 computed, the 11th token has its page
    list(iter_until_done(engine))
    assert engine.capacity().free_pages == 32  # cached pages count as free: they can be evicted


def iter_until_done(engine):
    while engine.has_unfinished():
        yield from engine.step()


def test_warm_up_leaves_no_trace_in_the_pool_the_cache_or_the_stats(make_engine):
    engine = make_engine()
    free_before, stats_before = engine.allocator.num_free, engine.stats()
    engine.warm_up()
    assert engine.allocator.num_free == free_before
    assert engine.stats() == stats_before
    assert engine.cache.evictable_pages == 0 and not engine.has_unfinished()
