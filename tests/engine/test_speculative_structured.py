"""Structured outputs under speculative decoding: every verified position is masked by the grammar
after the drafted tokens before it, so constrained outputs are those of the engine without
speculation, token for token, greedy or sampled, with penalties, through a reasoning block, and
when the output completes inside a draft (drafted tokens follow the known output's end)."""

import pytest

from producer_client.schema import SamplingParams
from tests.engine.speculative_support import ScriptedProposer, always_speculating
from tests.engine.test_engine import random_prompts
from tests.engine.test_speculative import assert_same_outputs
from tests.engine.test_structured import FORMAT, SAMPLINGS, THINK_END, assert_valid, constrained, drive
from worker.engine.grammar.constraint import Constraint, Thinking

VOCAB = 151936


def spec_engine(make_tiny_engine, outputs, wrong=lambda position: position % 4 == 3, **settings):
    engine = make_tiny_engine(speculative_method="ngram", num_speculative_tokens=4, **settings)
    engine.speculator.proposer = ScriptedProposer(outputs, VOCAB, wrong)
    return always_speculating(engine)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_constrained_outputs_equal_the_engine_without_speculation(make_tiny_engine, overlap):
    prompts = random_prompts(len(SAMPLINGS), 2, 30, seed=40)
    params = [SamplingParams(max_tokens=80, response_format=FORMAT, **p) for p in SAMPLINGS.values()]
    want = make_tiny_engine(overlap_schedule=overlap).generate(prompts, params)
    for out in want:
        assert_valid(out)
    engine = spec_engine(
        make_tiny_engine, {tuple(p): o.token_ids for p, o in zip(prompts, want)}, overlap_schedule=overlap
    )
    assert_same_outputs(engine.generate(prompts, params), want)
    stats = engine.stats()
    assert 0 < stats.accepted_draft_tokens < stats.draft_tokens


@pytest.mark.parametrize("inside", [True, False], ids=["inside-the-thinking", "after-it-closed"])
def test_a_reasoning_block_then_the_grammar_under_speculation(make_tiny_engine, inside):
    """Resumed inside the thinking (rows masked free but for EOS; the random model never closes it,
    so the output runs to its length) or just after </think> (the grammar behind whitespace)."""
    prompt = random_prompts(1, 5, 5, seed=57)[0]
    plain = make_tiny_engine()
    thought = plain.tokenizer.encode("<think>\nhmm {not json\n</think>\n\n", add_special_tokens=False)[1:]
    resume = thought[: thought.index(THINK_END) - 1] if inside else thought
    constraint = Constraint.of_format(constrained().response_format, Thinking(THINK_END))
    for params in (
        SamplingParams(temperature=0, max_tokens=60),
        SamplingParams(temperature=1.0, seed=3, max_tokens=60),
    ):
        want = drive(plain, {"t": (prompt, params, constraint, resume)})["t"]
        engine = spec_engine(make_tiny_engine, {tuple(prompt): resume + want[0]})
        got = drive(engine, {"t": (prompt, params, constraint, resume)})["t"]
        assert got[:2] == want[:2] and got[2].finish_reason == want[2].finish_reason
        assert want[2].finish_reason == ("length" if inside else "stop")
        assert engine.stats().accepted_draft_tokens > 0
