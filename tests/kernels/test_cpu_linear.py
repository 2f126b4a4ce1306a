"""The CPU engine's float32 kernel of the LM head and few-row projections (numba) against torch's matmul."""

import numba
import pytest
import torch

from kernels.cpu_decode_attention import paged_decode_attention_cpu
from kernels.cpu_linear import FEW_ROWS, linear_cpu
from tests.kernels.test_decode_attention import decode_case


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
@pytest.mark.parametrize("cols", [1, 7, 8, 9, 64 + 5])
def test_cpu_linear_matches_torch_for_every_row_and_column_remainder(rows, cols, check_close):
    # Up to FEW_ROWS x rows: blocks of 64 weight rows by pairs of x rows and an odd last one; more:
    # blocks of 8 weight rows by 2 x rows. These shapes hit each remainder path of both.
    g = torch.Generator().manual_seed(rows * 100 + cols)
    x, w = torch.randn(rows, 96, generator=g), torch.randn(cols, 96, generator=g)
    check_close("linear_cpu", linear_cpu(x, w), x @ w.T)


def test_cpu_linear_writes_into_out_and_reads_strided_inputs(check_close):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 128, generator=g)[::2]  # every other row: not contiguous
    w = torch.randn(40, 256, generator=g)[:, :128]
    out = torch.full((3, 40), float("nan"))
    assert linear_cpu(x, w, out) is out
    check_close("linear_cpu", out, x @ w.T)


@pytest.mark.parametrize("hidden", [96, 512, 1536])
def test_a_rows_logits_are_the_same_bits_alone_and_at_any_place_among_few_rows(hidden):
    # A speculative verify step computes 1 + k rows where the decode step without speculation
    # computes one: each row must come out bit for bit as it would alone, or greedy output could
    # differ on a near tie.
    g = torch.Generator().manual_seed(hidden)
    x, w = torch.randn(FEW_ROWS + 1, hidden, generator=g), torch.randn(203, hidden, generator=g)
    alone = linear_cpu(x[-1:], w)[0]
    others = x[:-1]
    for rows in range(1, FEW_ROWS + 1):
        for place in range(rows):
            step = torch.cat([others[:place], x[-1:], others[place : rows - 1]])
            assert torch.equal(linear_cpu(step, w)[place], alone), (rows, place)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_cpu_linear_propagates_a_nonfinite_input_to_its_row_only(value):
    x, w = torch.ones(3, 32), torch.ones(16, 32)
    x[1, 4] = value
    out = linear_cpu(x, w)
    assert torch.isfinite(out[[0, 2]]).all() and not torch.isfinite(out[1]).any()


def test_cpu_kernels_run_on_torch_thread_count_and_give_the_same_bits_on_any():
    # Each output element is computed by one thread, so the thread count cannot change the sums.
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(5, 64, generator=g), torch.randn(203, 64, generator=g)
    q, k_cache, v_cache, page_table, lens = decode_case(2, 64, 16, torch.float32, "cpu", [3, 70, 129])
    results = []
    threads_before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results.append((linear_cpu(x, w), paged_decode_attention_cpu(q, k_cache, v_cache, page_table, lens, 0.125)))
            assert numba.get_num_threads() == threads
    finally:
        torch.set_num_threads(threads_before)
    assert all(torch.equal(a, b) for a, b in zip(*results))
