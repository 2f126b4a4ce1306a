"""What a request's outputs say: stop conditions, text, penalties and logprobs, against exact expectations."""

import gc

import pytest
import torch

from producer_client.schema import SamplingParams
from tests.engine.test_engine import random_prompts
from worker.engine.outputs import RequestOutput, TokenCounts

PROMPT = random_prompts(1, 12, 12, seed=11)[0]


def greedy(engine, max_tokens=24, prompt=PROMPT, **params):
    return engine.generate([prompt], SamplingParams(temperature=0, max_tokens=max_tokens, **params))[0]


def stream(engine, request_id, prompt, params):
    """All of one request's deltas, stepping until it ends."""
    engine.add_request(request_id, prompt, params)
    outs = []
    while not (outs and outs[-1].finished):
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


def test_max_tokens_ends_with_length(make_engine, hf_greedy):
    out = greedy(make_engine(), max_tokens=5)
    assert out.finish_reason == "length"
    assert out.token_ids == hf_greedy(PROMPT, 5)


def test_a_stop_token_ends_the_request_and_its_text_is_not_emitted(make_engine, loaded):
    engine = make_engine()
    free = greedy(engine)
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = greedy(engine, stop_token_ids=[stop_id])
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]
    tokenizer = loaded[1]
    assert out.text == tokenizer.decode(free.token_ids[:first], skip_special_tokens=True)


def test_eos_stops_unless_ignored(make_engine):
    free = greedy(make_engine())
    eos = free.token_ids[3]
    first = free.token_ids.index(eos)
    engine = make_engine(eos_token_ids=[eos, 10**6])  # ids beyond the vocabulary are dropped
    assert greedy(engine).token_ids == free.token_ids[: first + 1]
    assert greedy(engine).finish_reason == "stop"
    ignored = greedy(engine, ignore_eos=True)
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"


def test_min_tokens_masks_stop_tokens_until_reached(make_engine, hf_greedy):
    free = greedy(make_engine())
    stop_id = free.token_ids[0]
    out = greedy(make_engine(), stop_token_ids=[stop_id], min_tokens=4)
    # Masking the stop id changes the first tokens; they equal transformers' greedy with the
    # same id suppressed for 4 tokens (its MinNewTokensLengthLogitsProcessor).
    want = hf_greedy(PROMPT, 24, eos_token_id=stop_id, min_new_tokens=4)
    assert out.token_ids == want
    assert stop_id not in out.token_ids[:4]
    assert out.finish_reason == ("stop" if want[-1] == stop_id and len(want) < 24 else "length")


def test_stop_string_is_cut_from_text_and_never_streamed(make_engine, loaded):
    tokenizer = loaded[1]
    engine = make_engine()
    free = greedy(engine, max_tokens=32)
    start = next(
        i for i in range(4, len(free.text) - 3) if free.text[i : i + 3].isascii() and free.text[i : i + 3].isprintable()
    )
    stop = free.text[start : start + 3]
    cut = free.text.index(stop)
    outs = stream(engine, "s", PROMPT, SamplingParams(temperature=0, max_tokens=32, stop=[stop]))
    # The stream only appends, so equal to the cut text means nothing past the cut was ever sent.
    assert "".join(o.text_delta for o in outs) == free.text[:cut]
    assert outs[-1].finish_reason == "stop"
    tokens = [t for o in outs for t in o.new_token_ids]
    # It ends on the first token whose text completes the stop string.
    n = next(n for n in range(1, 33) if stop in tokenizer.decode(free.token_ids[:n], skip_special_tokens=True))
    assert tokens == free.token_ids[:n]


def test_streamed_deltas_concatenate_to_the_final_text(make_engine):
    engine = make_engine()
    free = greedy(engine, max_tokens=20)
    outs = stream(engine, "t", PROMPT, SamplingParams(temperature=0, max_tokens=20))
    assert "".join(o.text_delta for o in outs) == free.text
    assert [t for o in outs for t in o.new_token_ids] == free.token_ids
    assert [o.usage.completion_tokens for o in outs] == list(range(1, 21))
    assert all(not o.finished for o in outs[:-1]) and outs[-1].finish_reason == "length"


def test_each_tokens_output_is_the_request_output_a_caller_would_make(make_engine):
    """A token's output that does not end its request is built in place (object.__new__, each slot
    set; see outputs.RequestOutput): each equals the one RequestOutput(...) makes from the same
    generation, its logprob included, so a field added to RequestOutput and not set there fails this."""
    free = greedy(make_engine(), max_tokens=5, logprobs=2)
    outs = stream(make_engine(), "t", PROMPT, SamplingParams(temperature=0, max_tokens=5, logprobs=2))
    assert outs[:-1] == [
        RequestOutput("t", [token], out.text_delta, False, None, TokenCounts(len(PROMPT), n, 0), [free.logprobs[n - 1]])
        for n, (token, out) in enumerate(zip(free.token_ids, outs[:-1]), 1)
    ]
    plain = stream(make_engine(), "p", PROMPT, SamplingParams(temperature=0, max_tokens=3))
    assert plain[:-1] == [
        RequestOutput("p", [token], out.text_delta, False, None, TokenCounts(len(PROMPT), n, 0))
        for n, (token, out) in enumerate(zip(free.token_ids, plain[:-1]), 1)
    ]


def test_repetition_penalty_matches_transformers(make_engine, hf_greedy):
    out = greedy(make_engine(), repetition_penalty=1.8)
    assert out.token_ids == hf_greedy(PROMPT, 24, repetition_penalty=1.8)
    assert out.token_ids != greedy(make_engine()).token_ids


def test_presence_penalty_stops_repeats_that_greedy_makes(make_engine):
    prompt = random_prompts(1, 6, 6, seed=21)[0]
    free = greedy(make_engine(), max_tokens=64, prompt=prompt)
    assert len(set(free.token_ids)) < 64  # greedy repeats itself
    penalized = greedy(make_engine(), max_tokens=64, prompt=prompt, presence_penalty=2.0, frequency_penalty=2.0)
    assert len(set(penalized.token_ids)) > len(set(free.token_ids))


def test_logprobs_are_the_models_own(make_engine, hf_model):
    out = greedy(make_engine(), max_tokens=6, logprobs=3)
    ids = torch.tensor([PROMPT + out.token_ids])
    with torch.inference_mode():
        ref = torch.log_softmax(hf_model(ids).logits[0, len(PROMPT) - 1 : -1].float(), -1)
    assert len(out.logprobs) == 6
    for pos, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[pos]
        assert lp.logprob == pytest.approx(ref[pos, lp.token_id].item(), abs=1e-4)
        top = ref[pos].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_a_steps_token_outputs_make_no_token_counts_until_their_usage_is_read(make_engine):
    """An output keeps its counts as ints (outputs.RequestOutput): the reader made a TokenCounts for
    every token's output of every step, which the worker reads only of a request's last."""
    engine = make_engine()
    engine.add_request("t", PROMPT, SamplingParams(temperature=0, max_tokens=8))
    before = sum(1 for o in gc.get_objects() if type(o) is TokenCounts)
    outs: list[RequestOutput] = []
    while len(outs) < 4:
        outs += engine.step()
    assert not any(o.finished for o in outs)
    assert sum(1 for o in gc.get_objects() if type(o) is TokenCounts) == before
    assert [o.usage for o in outs] == [TokenCounts(len(PROMPT), n, 0) for n in range(1, len(outs) + 1)]
