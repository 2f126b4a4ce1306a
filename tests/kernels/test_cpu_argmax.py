"""The CPU sampler's greedy argmax (numba) against torch.argmax."""

import pytest
import torch

from kernels.cpu_argmax import argmax_rows_cpu


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 1000, 151_936])
def test_cpu_argmax_matches_torch_for_random_rows(vocab):
    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab))
    assert torch.equal(argmax_rows_cpu(logits), logits.argmax(-1))


def test_cpu_argmax_takes_the_first_of_tied_maxima_wherever_they_fall():
    logits = torch.zeros(5, 200)
    logits[0, [3, 70]] = 1.0  # two blocks
    logits[1, [65, 66]] = 1.0  # one block
    logits[2, [0, 199]] = 1.0  # first element, and the unblocked tail
    logits[3, [198, 199]] = 1.0  # both in the tail
    # row 4: all equal
    assert argmax_rows_cpu(logits).tolist() == [3, 65, 0, 198, 0] == logits.argmax(-1).tolist()


def test_cpu_argmax_skips_masked_logits():
    logits = torch.full((3, 130), float("-inf"))
    logits[0, 129] = -5.0
    logits[1, 64] = 1e30
    assert argmax_rows_cpu(logits).tolist() == [129, 64, 0] == logits.argmax(-1).tolist()


def test_cpu_argmax_reads_a_strided_view():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))[:, ::2]
    assert torch.equal(argmax_rows_cpu(logits), logits.argmax(-1))


def test_cpu_argmax_flags_each_row_that_holds_a_nan_or_an_infinity():
    logits = torch.randn(6, 200, generator=torch.Generator().manual_seed(4))
    logits[1, 3], logits[2, 130], logits[3, 199], logits[4, 64] = float("nan"), float("inf"), float("-inf"), 3.4e38
    finite = torch.empty(6, dtype=torch.bool)
    tokens = argmax_rows_cpu(logits, finite)
    assert finite.tolist() == [True, False, False, False, True, True]  # the largest finite float is finite
    assert tokens[[0, 4, 5]].tolist() == logits[[0, 4, 5]].argmax(-1).tolist()
