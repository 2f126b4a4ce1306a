"""Speculative decoding is lossless: the engine's outputs with drafts verified are the outputs of
the same engine without them, token for token, text and finish reason, whatever the drafts, on
models of several shapes and with every feature a request can use."""

import pytest

from producer_client.schema import SamplingParams
from tests.engine.speculative_support import always_speculating, known_outputs, speculative
from tests.engine.support import VOCAB
from tests.engine.test_engine import assert_all_pages_free_after_clear, random_prompts
from worker.engine.speculative.ngram import NgramIndex

PROMPTS = random_prompts(6, 1, 40, seed=21)
GREEDY = SamplingParams(temperature=0, max_tokens=20)

# Which output positions a draft gets wrong: never, at every third, at every position, and
# at one every fifth, shifted (drafts cut at every depth).
PATTERNS = {
    "all-right": lambda p: False,
    "every-third-wrong": lambda p: p % 3 == 2,
    "all-wrong": lambda p: True,
    "fifth-wrong": lambda p: p % 5 == 1,
}


def assert_same_outputs(got, want) -> None:
    assert [(o.token_ids, o.text, o.finish_reason) for o in got] == [
        (o.token_ids, o.text, o.finish_reason) for o in want
    ]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_greedy_outputs_equal_the_engine_without_speculation_whatever_the_drafts(make_engine, pattern):
    want, known = known_outputs(make_engine(), PROMPTS, GREEDY)
    engine = speculative(make_engine, known, VOCAB, PATTERNS[pattern])
    assert_same_outputs(engine.generate(PROMPTS, GREEDY), want)
    stats = engine.stats()
    assert stats.draft_tokens == engine.speculator.proposer.proposed > 0
    if pattern == "all-wrong":
        assert stats.accepted_draft_tokens == 0
    if pattern == "all-right":
        # The prefill samples the first token; 4 steps then take the other 19, drafting 4, 4, 4 and 3.
        assert stats.accepted_draft_tokens == stats.draft_tokens == 6 * 15
    assert_all_pages_free_after_clear(engine)


@pytest.mark.parametrize("k", [1, 2, 7])
def test_any_draft_length_gives_the_same_outputs(make_engine, k):
    want, known = known_outputs(make_engine(), PROMPTS, GREEDY)
    engine = speculative(make_engine, known, VOCAB, PATTERNS["fifth-wrong"], k=k)
    assert_same_outputs(engine.generate(PROMPTS, GREEDY), want)


def test_the_ngram_proposer_drafts_what_followed_the_latest_occurrence_of_the_longest_suffix():
    index = NgramIndex()
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3]
    index.update(tokens)
    assert index.lookup(tokens, 4) == [4, 9, 2, 3]  # "1 2 3" occurred at the start
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 7, 2, 3]
    index = NgramIndex()
    index.update(tokens)
    assert index.lookup(tokens, 4) == [5, 6, 7, 2]  # "2 3", latest at positions 5-6
    tokens += [5, 6]
    index.update(tokens)
    assert index.lookup(tokens, 3) == [7, 2, 3]  # indexed incrementally: "2 3 5 6" ended at position 9
    assert index.lookup([7, 8], 3) == []


def test_ngram_drafts_on_repetitive_text_are_accepted_and_change_nothing(make_tiny_engine):
    prompts = [[11, 12, 13, 14, 15] * 4, [21, 22, 23] * 6 + [21]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = make_tiny_engine().generate(prompts, params)
    engine = always_speculating(make_tiny_engine(speculative_method="ngram"))
    assert_same_outputs(engine.generate(prompts, params), want)
    assert engine.stats().accepted_draft_tokens > 0


def stop_id_of(make_engine) -> int:
    return make_engine().generate(PROMPTS[:1], GREEDY)[0].token_ids[6]


# Per feature: what a request asks for. Each runs with drafts right up to a wrong one every fifth
# position, and FILLER drafted past the known output's end (a stop must cut the draft).
FEATURES = {
    "stop-token": lambda stop: dict(stop_token_ids=[stop]),
    "eos-and-min-tokens": lambda stop: dict(stop_token_ids=[stop], min_tokens=9),
    "penalties": lambda stop: dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
    "logprobs": lambda stop: dict(logprobs=3),
    "seeded-sampling": lambda stop: dict(temperature=0.9, top_p=0.95, top_k=40, min_p=0.01, seed=7),
    "seeded-sampling-with-penalties": lambda stop: dict(temperature=1.0, seed=3, repetition_penalty=1.2),
    "opted-out": lambda stop: dict(speculative=False),
}


@pytest.mark.parametrize("feature", FEATURES)
def test_each_request_feature_gives_the_outputs_it_gives_without_speculation(make_engine, feature):
    params = [
        SamplingParams(**{"max_tokens": 20, "temperature": 0, **FEATURES[feature](stop_id_of(make_engine))}),
        GREEDY,  # beside a plain request
    ] * 3
    want, known = known_outputs(make_engine(), PROMPTS, params)
    engine = speculative(make_engine, known, VOCAB, PATTERNS["fifth-wrong"])
    got = engine.generate(PROMPTS, params)
    assert_same_outputs(got, want)
    assert engine.stats().accepted_draft_tokens > 0
    for g, w in zip(got, want):
        assert g.usage == w.usage
        if w.logprobs is not None:
            assert [lp.token_id for lp in g.logprobs] == [lp.token_id for lp in w.logprobs]
            assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)
            assert [[t for t, _ in lp.top] for lp in g.logprobs] == [[t for t, _ in lp.top] for lp in w.logprobs]
    assert_all_pages_free_after_clear(engine)


def test_eos_ends_a_request_inside_an_accepted_draft(make_engine):
    eos = stop_id_of(make_engine)
    want, known = known_outputs(make_engine(eos_token_ids=[eos]), PROMPTS, GREEDY)
    engine = speculative(make_engine, known, VOCAB, eos_token_ids=[eos])
    assert_same_outputs(engine.generate(PROMPTS, GREEDY), want)
    assert want[0].finish_reason == "stop"


def test_an_opted_out_request_gets_no_draft(make_engine):
    params = [SamplingParams(max_tokens=20, temperature=0, speculative=False)] * len(PROMPTS)
    want, known = known_outputs(make_engine(), PROMPTS, params)
    engine = speculative(make_engine, known, VOCAB)
    assert_same_outputs(engine.generate(PROMPTS, params), want)
    assert engine.stats().draft_tokens == 0


def test_a_stop_string_ends_the_stream_where_it_would_without_speculation(make_engine):
    free = make_engine().generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=32))[0]
    stop = free.text[5:8]
    params = SamplingParams(temperature=0, max_tokens=32, stop=[stop])
    want = make_engine().generate(PROMPTS[:1], params)
    engine = speculative(make_engine, {tuple(PROMPTS[0]): free.token_ids}, VOCAB)
    engine.add_request("s", PROMPTS[0], params)
    deltas = []
    while engine.has_unfinished():
        deltas += [o for o in engine.step() if o.request_id == "s"]
    assert want[0].finish_reason == "stop"
    assert "".join(o.text_delta for o in deltas) == want[0].text  # nothing past the cut was ever sent
    assert [t for o in deltas for t in o.new_token_ids] == want[0].token_ids
    assert len(deltas) < len(want[0].token_ids)  # steps took several tokens


@pytest.mark.parametrize(
    "settings",
    [
        dict(max_num_batched_tokens=24, max_running=8),  # prefill chunks beside verify chunks, drafts cut by the budget
        dict(num_pages=24),  # preemption: a pool too small for every request at once
        dict(overlap_schedule=True),
        dict(max_model_len=48),  # drafts end where the context does
        dict(kv_cache_dtype="fp8_e4m3"),
    ],
    ids=["small-budget", "preemption", "overlap", "max-model-len", "fp8-kv"],
)
def test_engine_settings_change_no_output(make_engine, settings):
    params = SamplingParams(temperature=0, max_tokens=20)
    want, known = known_outputs(make_engine(**settings), PROMPTS, params)
    engine = speculative(make_engine, known, VOCAB, PATTERNS["every-third-wrong"], **settings)
    assert_same_outputs(engine.generate(PROMPTS, params), want)
    if "num_pages" in settings:
        assert engine.stats().preemptions > 0
    assert_all_pages_free_after_clear(engine)


def test_the_prefix_cache_holds_only_accepted_tokens(make_engine):
    params = SamplingParams(temperature=0, max_tokens=20)
    want, known = known_outputs(make_engine(), PROMPTS, params)
    engine = speculative(make_engine, known, VOCAB, PATTERNS["all-wrong"])
    engine.generate(PROMPTS, params)
    sequences = [p + o.token_ids for p, o in zip(PROMPTS, want)]
    for key in cached_keys(engine.cache.root, []):
        assert any(s[: len(key)] == key for s in sequences), "a cached page holds a token no request kept"
    # A prompt that continues a finished request's sequence hits its cached pages, rejected drafts none.
    longer = sequences[2][:-3]
    again = engine.generate([longer], params)[0]
    assert again.usage.cached_prompt_tokens == (len(longer) - 1) // 4 * 4
    assert again.token_ids == make_engine().generate([longer], params)[0].token_ids


def cached_keys(node, prefix: list[int]):
    for child in node.children.values():
        key = prefix + child.key
        yield key
        yield from cached_keys(child, key)


def test_a_resumed_request_continues_as_if_never_interrupted(make_engine):
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=20)
    want, known = known_outputs(make_engine(), PROMPTS[:1], params)
    engine = speculative(make_engine, known, VOCAB, PATTERNS["every-third-wrong"])
    engine.add_request("r", PROMPTS[0], params, resume_token_ids=want[0].token_ids[:7])
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert want[0].token_ids[:7] + tokens == want[0].token_ids
