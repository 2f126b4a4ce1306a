"""The token-bitmask kernels (Triton, and numba on CPU) against the torch reference: masked
rows get -inf exactly where their mask's bit is 0, other rows are untouched."""

import pytest
import torch

from kernels.token_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_cpu,
    apply_token_bitmask_reference,
    apply_token_bitmask_triton,
    words_for,
)


def random_case(rows: int, vocab: int, masked: list[int], mask_table_rows: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (mask_table_rows, words_for(vocab)), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[0] = -1  # a row that allows everything
    bitmask[-1] = 0  # and one that allows nothing
    mask_rows = torch.randint(0, mask_table_rows, (len(masked),), generator=gen)
    return logits, bitmask, torch.tensor(masked, dtype=torch.long), mask_rows


def expected(logits, bitmask, logit_rows, mask_rows):
    out = logits.clone()
    for r, m in zip(logit_rows.tolist(), mask_rows.tolist()):
        for t in range(logits.shape[1]):
            if not (int(bitmask[m, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def test_reference_masks_exactly_the_cleared_bits():
    logits, bitmask, logit_rows, mask_rows = random_case(4, 70, [0, 2, 3], 3, seed=0)
    want = expected(logits, bitmask, logit_rows, mask_rows)
    apply_token_bitmask_reference(logits, bitmask, logit_rows, mask_rows)
    assert torch.equal(logits, want)


@pytest.mark.parametrize("rows,vocab,masked", [(1, 32, [0]), (5, 1000, [4, 0, 2]), (3, 2100, [1]), (6, 97, [])])
def test_triton_matches_reference(rows, vocab, masked, device):
    logits, bitmask, logit_rows, mask_rows = random_case(rows, vocab, masked, 4, seed=vocab)
    want = logits.clone()
    apply_token_bitmask_reference(want, bitmask, logit_rows, mask_rows)
    got = logits.to(device)
    apply_token_bitmask_triton(got, bitmask.to(device), logit_rows.to(device), mask_rows.to(device))
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize(
    "rows,vocab,masked", [(1, 32, [0]), (5, 1000, [4, 0, 2]), (3, 2100, [1]), (8, 151936, [0, 3, 7])]
)
def test_cpu_kernel_matches_reference(rows, vocab, masked):
    logits, bitmask, logit_rows, mask_rows = random_case(rows, vocab, masked, 4, seed=vocab)
    want = logits.clone()
    apply_token_bitmask_reference(want, bitmask, logit_rows, mask_rows)
    apply_token_bitmask_cpu(logits, bitmask, logit_rows, mask_rows)
    assert torch.equal(logits, want)


def test_tokens_past_the_masks_words_are_forbidden():
    logits = torch.zeros(1, 40)
    bitmask = torch.full((1, 1), -1, dtype=torch.int32)  # 32 tokens' worth of words
    rows = torch.zeros(1, dtype=torch.long)
    for apply in (apply_token_bitmask_reference, apply_token_bitmask_cpu):
        out = logits.clone()
        apply(out, bitmask, rows, rows)
        assert torch.isinf(out[0, 32:]).all() and not torch.isinf(out[0, :32]).any()


def test_dispatch_masks_float32_cpu_logits_in_place():
    logits, bitmask, logit_rows, mask_rows = random_case(3, 300, [1, 2], 3, seed=7)
    want = logits.clone()
    apply_token_bitmask_reference(want, bitmask, logit_rows, mask_rows)
    apply_token_bitmask(logits, bitmask, logit_rows, mask_rows)
    assert torch.equal(logits, want)
