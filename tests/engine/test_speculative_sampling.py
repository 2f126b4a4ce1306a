"""Sampled speculative decoding leaves the target distribution unchanged.

A model whose next-token distribution depends on the input token alone (a Markov chain on three
tokens) samples thousands of requests with drafts that are right only as often as the chain makes
them: the joint distribution of each request's first three output tokens, two of them verified, is
tested against the chain's with Pearson's chi-squared at significance level ALPHA.

Verification takes a drafted token d exactly when the target's own draw at that position equals
it, which happens with probability p(d); given a rejection the draw is distributed as p without d,
renormalized: Leviathan et al.'s rule for a draft that proposes d with certainty (accept with
probability min(1, p(d) / q(d)) = p(d), else sample from norm(max(0, p - q)))."""

from types import SimpleNamespace

import pytest
import torch

from producer_client.schema import SamplingParams
from tests.engine.speculative_support import always_speculating
from tests.engine.support import VOCAB
from worker.engine import Engine, EngineSettings
from worker.model.parallel import SINGLE

ALPHA = 1e-3
# Row t: the probabilities of tokens 0, 1, 2 after token t; every other token is (almost) never drawn.
CHAIN = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.5, 0.3], [0.3, 0.2, 0.5]], dtype=torch.float64)
PROMPT = [2]
DRAFT = [0, 0, 0]
REQUESTS = 6000


class MarkovModel:
    """Logits log CHAIN[input token] on tokens 0..2, -1e4 elsewhere (finite: exp underflows to 0)."""

    def __init__(self):
        self.model = SimpleNamespace(norm=SimpleNamespace(weight=torch.zeros(1)))  # the KV dtype
        self.tp = SINGLE

    def __call__(self, input_ids, positions, meta, kv_caches, lora=None):
        return input_ids[:, None]

    def modules(self):
        return iter(())  # no LoRA adapter slots

    def compute_logits(self, hidden, out=None):
        logits = torch.full((hidden.shape[0], VOCAB), -1e4)
        logits[:, :3] = CHAIN.log().float()[hidden[:, 0] % 3]
        return logits if out is None else out.copy_(logits)

    def warm_up_experts(self, max_tokens: int) -> None:
        pass


class FixedDraft:
    def observe(self, chunks) -> None:
        pass

    def propose(self, requests, limits):
        return [DRAFT[:limit] for limit in limits]


@pytest.fixture
def markov_engine(loaded):
    (_, config, _), tokenizer = loaded

    def make(**settings) -> Engine:
        settings = {"num_pages": 4096, "page_size": 4, "max_running": 256, **settings}
        engine = Engine(MarkovModel(), config, tokenizer, EngineSettings.parse(**settings), [], torch.device("cpu"))
        if engine.speculator is not None:
            engine.speculator.proposer = FixedDraft()
            always_speculating(engine)
        return engine

    return make


def chi_squared_p_value(observed: torch.Tensor, probabilities: torch.Tensor) -> float:
    expected = probabilities * observed.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2).item()


def test_verified_tokens_follow_the_target_distribution(markov_engine):
    # Seeded: unseeded, a right sampler fails at ALPHA once in a thousand runs (a quick lane of the
    # lead's read p = 1.2e-4); a biased one fails at any seed over 6000 requests.
    torch.manual_seed(20261201)
    engine = markov_engine(speculative_method="ngram", num_speculative_tokens=3)
    outputs = engine.generate([PROMPT] * REQUESTS, SamplingParams(temperature=1.0, max_tokens=3))
    observed = torch.zeros(3, 3, 3, dtype=torch.float64)
    for out in outputs:
        a, b, c = out.token_ids
        observed[a, b, c] += 1
    joint = CHAIN[PROMPT[-1]][:, None, None] * CHAIN[:, :, None] * torch.stack([CHAIN] * 3)  # p(a) p(b|a) p(c|b)
    assert joint.sum().item() == pytest.approx(1.0)
    p_value = chi_squared_p_value(observed, joint)
    assert p_value > ALPHA, f"chi-squared p-value {p_value:.2e} over {REQUESTS} requests"
    stats = engine.stats()
    assert 0.2 * stats.draft_tokens < stats.accepted_draft_tokens < 0.6 * stats.draft_tokens


def test_a_seeded_request_draws_the_same_tokens_with_or_without_speculation_whatever_shares_its_steps(markov_engine):
    seeded = SamplingParams(temperature=1.0, max_tokens=12, seed=1234)
    alone = markov_engine().generate([PROMPT], seeded)[0].token_ids
    crowd = [SamplingParams(temperature=1.0, max_tokens=n) for n in range(1, 12)]
    for speculative in (False, True):
        settings = {"speculative_method": "ngram", "num_speculative_tokens": 3} if speculative else {}
        engine = markov_engine(**settings)
        outputs = engine.generate([PROMPT] * 12, [*crowd[:5], seeded, *crowd[5:]])
        assert outputs[5].token_ids == alone
