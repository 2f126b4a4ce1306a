import math

import pytest
import torch

from producer_client.schema import SamplingParams
from worker.engine.request import Request
from worker.engine.sampler import Sampler, apply_penalties, rows_finite

V = 8


def make_request(prompt=(0,), output=(), **params) -> Request:
    p = SamplingParams(**params)
    gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
    req = Request("r", list(prompt), p, 0, 0, text=None, generator=gen)
    req.token_ids.extend(output)
    return req


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0, 0, 0, 0, 0, 0], [5.0, 0, 0, 0, 0, 0, 0, 9.0]])
    out = Sampler([])(logits, [make_request(temperature=0), make_request(temperature=0)])
    assert out.token_ids == [1, 7]
    assert out.logprobs == [None, None]


def test_rows_finite_flags_each_kind_of_nonfinite_value_and_nothing_else():
    logits = torch.zeros(6, V)
    logits[1, 3], logits[2, 0], logits[3, 7] = float("nan"), float("inf"), float("-inf")
    logits[4, 2], logits[5] = -3.4e38, 3.4e38  # the largest finite floats stay finite
    assert rows_finite(logits).tolist() == [True, False, False, False, True, True]


def test_top_k_1_and_a_tiny_top_p_are_greedy_even_when_sampling():
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(0))
    reqs = [make_request(temperature=1.5, top_k=1)] * 8 + [make_request(temperature=1.5, top_p=1e-6)] * 8
    assert Sampler([])(logits, reqs).token_ids == logits.argmax(-1).tolist()


def test_filters_keep_draws_inside_the_allowed_set():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0, -3.0]]).repeat(400, 1)
    sampler = Sampler([])
    top_k = sampler(logits, [make_request(top_k=3)] * 400).token_ids
    assert set(top_k) == {0, 1, 2}
    # probs ~ .64 .23 .09 .03 ...: the smallest set reaching 0.8 is {0, 1}
    top_p = sampler(logits, [make_request(top_p=0.8)] * 400).token_ids
    assert set(top_p) == {0, 1}
    # min_p 0.1 keeps tokens with p >= 0.064: {0, 1, 2}
    min_p = sampler(logits, [make_request(min_p=0.1)] * 400).token_ids
    assert set(min_p) == {0, 1, 2}


def test_draws_follow_the_temperature_scaled_distribution():
    logits = torch.tensor([[1.0, 0.0, -1.0, -9, -9, -9, -9, -9]]).repeat(20000, 1)
    tokens = torch.tensor(Sampler([])(logits, [make_request(temperature=2.0)] * 20000).token_ids)
    freq = torch.bincount(tokens, minlength=V).float() / len(tokens)
    expected = (logits[0] / 2.0).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.015)


def test_seeded_rows_repeat_whatever_else_is_in_the_batch():
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(1))
    others = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))

    def run(batch_logits, row, n_others):
        req = make_request(seed=1234, temperature=1.0)
        reqs = [make_request(temperature=1.0) for _ in range(n_others)]
        reqs.insert(row, req)
        sampler = Sampler([])
        return [sampler(batch_logits, reqs).token_ids[row] for _ in range(12)]

    alone = run(logits, 0, 0)
    mixed = run(torch.cat([others[:3], logits, others[3:]]), 3, 5)
    assert alone == mixed
    assert len(set(alone)) > 1  # it does sample


def test_repetition_penalty_covers_prompt_and_output_presence_and_frequency_only_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0, 1.0, 1.0, 1.0]])
    req = make_request(
        prompt=[0, 1], output=[2, 3, 3], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    apply_penalties(logits, [req])
    expected = [
        1.0,  # prompt, positive: divided
        -4.0,  # prompt, negative: multiplied
        1.0 - 0.5 - 0.25,  # output once
        -4.0 - 0.5 - 0.5,  # output twice
        2.0,
        1.0,
        1.0,
        1.0,
    ]
    assert logits[0].tolist() == pytest.approx(expected)


def test_rows_without_penalties_are_untouched():
    logits = torch.ones(2, V)
    apply_penalties(logits, [make_request(output=[1, 1]), make_request(output=[1], frequency_penalty=1.0)])
    assert logits[0].tolist() == [1.0] * V
    assert logits[1, 1].item() == 0.0


def test_eos_and_stop_ids_are_masked_until_min_tokens():
    logits = torch.tensor([[0.0, 9.0, 8.0, 7.0, 0, 0, 0, 0]]).repeat(3, 1)
    reqs = [
        make_request(output=[5], min_tokens=2, stop_token_ids=[2], temperature=0),  # 1 < 2: eos 1 and 2 masked
        make_request(output=[5], min_tokens=2, ignore_eos=True, temperature=0),  # eos not a stop when ignored
        make_request(output=[5, 5], min_tokens=2, temperature=0),  # reached: nothing masked
    ]
    assert Sampler([1])(logits, reqs).token_ids == [3, 1, 1]


def test_logprobs_are_the_raw_distribution_with_the_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0, 0, 0, 0, 0]])
    lp = torch.log_softmax(logits[0], -1)
    out = Sampler([])(logits, [make_request(temperature=0, logprobs=2, repetition_penalty=5.0, prompt=[1])])
    (got,) = out.logprobs
    # The penalty moves token 1 (3 -> 0.6) below token 2, which is sampled; logprobs stay raw.
    assert got.token_id == 2
    assert got.logprob == pytest.approx(lp[2].item())
    assert [t for t, _ in got.top] == [1, 2]
    assert [v for _, v in got.top] == pytest.approx([lp[1].item(), lp[2].item()])


def test_logprobs_zero_gives_only_the_sampled_token():
    out = Sampler([])(torch.zeros(1, V), [make_request(temperature=0, logprobs=0)])
    assert out.logprobs[0].top == ()
    assert out.logprobs[0].logprob == pytest.approx(-math.log(V))


def test_penalty_counts_carried_across_steps_equal_counts_from_the_token_lists():
    """Greedy draws under every penalty for 40 steps, two requests, one of them resumed with
    earlier output: the sampler's carried-over counts penalize as the lists would."""
    g = torch.Generator().manual_seed(7)
    params = dict(temperature=0, repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.4)
    reqs = [make_request(prompt=[0, 1, 2], **params), make_request(prompt=[3], output=[4, 4, 5], **params)]
    sampler = Sampler([])
    for _ in range(40):
        logits = torch.randn(2, V, generator=g) + torch.arange(V) * 0.1  # greedy would repeat the top ids
        expected = logits.clone()
        apply_penalties(expected, reqs)
        tokens = sampler(logits, reqs).token_ids
        assert tokens == expected.argmax(-1).tolist()
        for req, token in zip(reqs, tokens):
            req.token_ids.append(token)
    assert len(set(reqs[0].output_token_ids)) == V  # the penalties made it cycle through every id
