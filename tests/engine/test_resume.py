"""Resuming a request from output tokens an earlier run produced (a job reclaimed from a worker
that died): what follows is what an uninterrupted run produces, nothing is emitted twice, and
usage counts every token once."""

import pytest

from producer_client.errors import InvalidArgument
from producer_client.schema import SamplingParams
from tests.engine.support import VOCAB
from tests.engine.test_engine import random_prompts


def run(engine, request_id, prompt, params, resume=()):
    """[(token ids, text delta)] of every output, and the final output."""
    engine.add_request(request_id, prompt, params, resume_token_ids=resume)
    deltas = []
    while True:
        for out in engine.step():
            if out.request_id != request_id:
                continue
            deltas.append((out.new_token_ids, out.text_delta))
            if out.finished:
                return deltas, out


def tokens_of(deltas):
    return [t for ids, _ in deltas for t in ids]


def text_of(deltas):
    return "".join(text for _, text in deltas)


def assert_resumes_exactly(engine, prompt, params, cut):
    whole, whole_final = run(engine, "whole", prompt, params)
    before = whole[:cut]  # one delta per token until the end: the tokens the first run published
    resumed, final = run(engine, "resumed", prompt, params, resume=tokens_of(before))
    assert tokens_of(before) + tokens_of(resumed) == tokens_of(whole)
    assert text_of(before) + text_of(resumed) == text_of(whole)
    assert final.finish_reason == whole_final.finish_reason
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), len(tokens_of(whole)))
    return whole, resumed


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_resumed_greedy_request_continues_exactly_where_it_stopped(make_engine, cut):
    engine = make_engine()
    for prompt in random_prompts(3, 3, 40, seed=20):
        _, resumed = assert_resumes_exactly(engine, prompt, SamplingParams(temperature=0, max_tokens=12), cut)
        assert len(tokens_of(resumed)) == 12 - cut  # the recorded tokens are not emitted again


def test_resumed_tokens_count_for_penalties_and_min_tokens(make_engine):
    params = SamplingParams(
        temperature=0,
        max_tokens=16,
        min_tokens=10,
        repetition_penalty=1.5,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        stop_token_ids=[7],
    )
    for prompt in random_prompts(3, 5, 20, seed=21):
        assert_resumes_exactly(make_engine(), prompt, params, cut=6)


def test_a_stop_string_that_straddles_the_resume_point_still_stops(make_engine):
    engine = make_engine()
    prompt = random_prompts(1, 10, 10, seed=22)[0]
    free, _ = run(engine, "free", prompt, SamplingParams(temperature=0, max_tokens=12))
    stop = text_of(free[5:7])  # the text of outputs 6 and 7: a run with this stop ends at output 7
    assert stop
    params = SamplingParams(temperature=0, max_tokens=12, stop=[stop])
    stopped, final = run(engine, "stopped", prompt, params)
    assert final.finish_reason == "stop"
    # Resume after all but the last token: the partial match held back must carry over.
    assert_resumes_exactly(engine, prompt, params, cut=len(stopped) - 1)


def test_a_seeded_request_draws_as_if_never_interrupted(make_engine):
    params = SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=14)
    for prompt in random_prompts(2, 5, 20, seed=23):
        assert_resumes_exactly(make_engine(), prompt, params, cut=6)


def test_resume_tokens_are_checked_like_any_input(make_engine):
    engine = make_engine(max_model_len=32)
    ok = SamplingParams(max_tokens=8)
    cases = [
        (dict(resume_token_ids=[VOCAB]), "resume_token_ids"),
        (dict(resume_token_ids=[-1]), "resume_token_ids"),
        (dict(resume_token_ids=[1] * 8), "resume_token_ids"),  # max_tokens reached already
        (dict(prompt_token_ids=[1] * 28, resume_token_ids=[1] * 4), "resume_token_ids"),  # max_model_len reached
    ]
    for kwargs, field in cases:
        with pytest.raises(InvalidArgument) as e:
            engine.add_request(**{"request_id": "x", "prompt_token_ids": [1, 2], "params": ok, **kwargs})
        assert e.value.field == field
