"""Random draws settled among each row's most likely candidates keep the exact distribution of
the full sort: the same kept sets, the same frequencies (chi-squared against the full-sort path
on a fixed logits matrix), and for seeded rows the very same tokens."""

import pytest
import torch

from producer_client.schema import SamplingParams
from worker.engine.random_sampling import (
    CANDIDATES,
    DrawParams,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    draw_from_candidates,
    draw_from_full_rows,
    draw_seeded_noise,
    sample_random,
)
from worker.engine.request import Request

V = 64
FEW = 12  # candidates per row in these tests, so that cuts fall inside and outside them
DRAWS = 30_000  # per row and path


def request(seed=None, **params) -> Request:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return Request("r", [0], SamplingParams(**params), 0, 0, None, generator)


def fixed_logits() -> torch.Tensor:
    """Rows of a peaked, a flat, a tied and a staircase shape (the row each case below uses)."""
    g = torch.Generator().manual_seed(1234)
    peaked = torch.randn(V, generator=g) * 3
    flat = torch.randn(V, generator=g) * 0.3
    tied = torch.randn(V, generator=g).mul(2).round()  # many equal logits
    # Probabilities 0.4, 0.3, 0.2, 0.06, then a tail: the mass before the 4th token is 0.9.
    staircase = torch.tensor([0.4, 0.3, 0.2, 0.06] + [0.04 / (V - 4)] * (V - 4)).log()
    return torch.stack([peaked, peaked, peaked, flat, flat, tied, tied, peaked, staircase, staircase])


CASES = [  # (params of the row, whether its cut falls inside its FEW candidates)
    (dict(temperature=0.8, top_p=0.9), True),
    (dict(temperature=1.3, top_k=5, top_p=0.8), True),
    (dict(temperature=1.0, min_p=0.05), True),
    (dict(temperature=1.0, top_p=0.97), False),  # a flat row: its nucleus holds most of the vocabulary
    (dict(temperature=0.7, top_k=30), False),  # more than FEW
    (dict(temperature=1.0, top_k=3), True),  # ties with the 3rd largest are kept
    (dict(temperature=1.0, top_p=0.5), True),
    (dict(temperature=1.0, top_k=12, top_p=0.99), False),  # top_k == FEW: ties past the candidates unknown
    (dict(temperature=1.0, top_p=0.89), True),  # the 4th token's mass before it, 0.9, just reaches p: dropped
    (dict(temperature=1.0, top_p=0.91), True),  # ... and just short of p: kept
]


def chi_squared_p_value(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the hypothesis that two count vectors come from one distribution (homogeneity)."""
    seen = (a + b) > 0
    a, b = a[seen].double(), b[seen].double()
    total = a.sum() + b.sum()
    expected_a, expected_b = (a + b) * a.sum() / total, (a + b) * b.sum() / total
    statistic = ((a - expected_a) ** 2 / expected_a + (b - expected_b) ** 2 / expected_b).sum()
    dof = seen.sum() - 1
    if dof == 0:
        return 1.0
    return torch.special.gammaincc(dof.double() / 2, statistic / 2).item()


def counts(tokens: torch.Tensor) -> torch.Tensor:
    """[rows, V] token frequencies of draws laid out row-major, DRAWS per row."""
    return torch.stack([torch.bincount(row, minlength=V) for row in tokens.view(-1, DRAWS)])


def kept_by_full_sort(logits: torch.Tensor, params: DrawParams) -> torch.Tensor:
    """[rows, V] bool: the tokens the full-sort filters keep, as draw_from_full_rows applies them."""
    scaled = logits / params.temperature
    if params.uses_min_p:
        apply_min_p(scaled, params.min_p)
    if params.max_top_k:
        apply_top_k(scaled, params.top_k, params.max_top_k)
    if params.uses_top_p:
        scaled = apply_top_p(scaled, params.top_p)
    return scaled.isfinite()


def test_candidate_draws_follow_the_full_sort_distribution_row_by_row():
    logits = fixed_logits()
    rows = [request(**params) for params, _ in CASES]
    repeated = logits.repeat_interleave(DRAWS, dim=0)
    params = DrawParams.of([r for r in rows for _ in range(DRAWS)], repeated.device)
    no_noise = draw_seeded_noise([], V, repeated.device)

    torch.manual_seed(1)
    tokens, settled = draw_from_candidates(repeated, params, no_noise, FEW)
    torch.manual_seed(2)
    reference = draw_from_full_rows(repeated, params, no_noise)

    assert settled.view(-1, DRAWS).all(dim=1).tolist() == [inside for _, inside in CASES]
    assert settled.view(-1, DRAWS).any(dim=1).tolist() == [inside for _, inside in CASES]
    kept = kept_by_full_sort(logits, DrawParams.of(rows, logits.device))
    ours, theirs = counts(tokens), counts(reference)
    for row, (params_of_row, inside) in enumerate(CASES):
        assert torch.equal(theirs[row] > 0, kept[row]), f"row {row} {params_of_row}: the reference's own kept set"
        if not inside:
            continue  # sample_random draws those rows by the full sort
        assert torch.equal(ours[row] > 0, kept[row]), f"row {row} {params_of_row}: kept sets differ"
        p = chi_squared_p_value(ours[row], theirs[row])
        assert p > 1e-3, f"row {row} {params_of_row}: chi-squared p-value {p:.2e}"
    assert kept[8].sum() == 3 and kept[9].sum() == 4


@pytest.mark.parametrize("case", range(len(CASES)))
def test_a_seeded_row_draws_the_same_token_either_way(case):
    """Both paths race the same q from the request's generator, so they agree token for token."""
    logits = fixed_logits()[case : case + 1]
    params_of_row, inside = CASES[case]
    for seed in range(40):
        ours, theirs = request(seed, **params_of_row), request(seed, **params_of_row)
        params = DrawParams.of([ours], logits.device)
        token, settled = draw_from_candidates(logits, params, draw_seeded_noise([ours], V, logits.device), FEW)
        assert settled.item() == inside
        expected = draw_from_full_rows(logits, params, draw_seeded_noise([theirs], V, logits.device))
        if inside:
            assert token.item() == expected.item(), f"seed {seed}"


def test_sample_random_settles_what_it_can_and_sorts_the_rest():
    """Above CANDIDATES tokens: a peaked row is settled among its candidates, a flat one by the
    full sort; seeded, each draws what the full sort alone draws."""
    g = torch.Generator().manual_seed(5)
    vocab = 4 * CANDIDATES
    logits = torch.stack([torch.randn(vocab, generator=g) * 4, torch.randn(vocab, generator=g) * 0.1])
    params = dict(temperature=0.9, top_p=0.95)
    for seed in range(10):
        rows = [request(seed, **params), request(seed + 100, **params)]
        draw = DrawParams.of(rows, logits.device)
        assert draw_from_candidates(logits, draw, draw_seeded_noise(rows, vocab, logits.device), CANDIDATES)[
            1
        ].tolist() == [
            True,
            False,
        ]
        rows = [request(seed, **params), request(seed + 100, **params)]
        tokens = sample_random(logits.clone(), DrawParams.of(rows, logits.device))
        again = [request(seed, **params), request(seed + 100, **params)]
        noise = draw_seeded_noise(again, vocab, logits.device)
        assert tokens.tolist() == draw_from_full_rows(logits, DrawParams.of(again, logits.device), noise).tolist()
