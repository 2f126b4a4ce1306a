"""LoRA's shrink and expand (kernels/lora_shrink.py, lora_expand.py) against a per-row loop over
each row's adapter, and the Triton kernels against the torch references: batches where rows use
different adapters of different ranks (8, 16, 64, 128), base rows among them, slots no row uses,
slices of one fused projection with ranks of their own (a slice an adapter leaves out: rank 0),
decode-like batches (a row or two per adapter) and prefill-like ones (long runs)."""

import itertools

import pytest
import torch

from kernels.lora_expand import lora_expand_reference, lora_expand_triton
from kernels.lora_shrink import lora_shrink_reference, lora_shrink_triton

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


class Stack:
    """One projection's adapters in the kernels' layout: A [S, n * R, in], B [S, out, R], zero past
    each (slot, slice)'s rank, with the ranks and scales."""

    def __init__(self, ranks: list[list[int]], max_rank: int, hidden: int, widths: list[int], seed: int):
        g = torch.Generator().manual_seed(seed)
        slots, n = len(ranks), len(widths)
        self.ranks = torch.tensor(ranks, dtype=torch.int32)
        self.scales = torch.rand(slots, n, generator=g) * 2 + 0.25
        self.slices = tuple([0] + torch.tensor(widths).cumsum(0).tolist())
        self.a = torch.zeros(slots, n * max_rank, hidden)
        self.b = torch.zeros(slots, self.slices[-1], max_rank)
        for slot in range(slots):
            for s, r in enumerate(ranks[slot]):
                self.a[slot, s * max_rank : s * max_rank + r] = torch.randn(r, hidden, generator=g) * hidden**-0.5
                self.b[slot, self.slices[s] : self.slices[s + 1], :r] = (
                    torch.randn(widths[s], r, generator=g) * max(r, 1) ** -0.5
                )
        self.max_rank = max_rank

    def to(self, dtype: torch.dtype, device: str) -> "Stack":
        self.a, self.b = self.a.to(dtype=dtype, device=device), self.b.to(dtype=dtype, device=device)
        self.ranks, self.scales = self.ranks.to(device), self.scales.to(device)
        return self


def grouped(token_slots: list[int], slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens grouped by slot, group ends); -1 is a base row, not listed."""
    t = torch.tensor(token_slots)
    tokens = torch.argsort(torch.where(t < 0, slots, t), stable=True)[: int((t >= 0).sum())]
    ends = torch.cumsum(torch.bincount(t[t >= 0], minlength=slots), 0).to(torch.int32)
    return tokens, ends


def per_row_loop(x, out, stack: Stack, token_slots: list[int]) -> torch.Tensor:
    """Each row's update on its own, in float32: scale * B_s (A_s x) per slice, as peft computes it."""
    expected = out.float().clone()
    for t, slot in enumerate(token_slots):
        if slot < 0:
            continue
        for s, (lo, hi) in enumerate(itertools.pairwise(stack.slices)):
            r = int(stack.ranks[slot, s])
            a = stack.a[slot, s * stack.max_rank : s * stack.max_rank + r].float()
            b = stack.b[slot, lo:hi, :r].float()
            expected[t, lo:hi] += stack.scales[slot, s].float() * (b @ (a @ x[t].float()))
    return expected


# (ranks per slot and slice, max rank, hidden, slice widths, each row's slot)
CASES = {
    "qkv-decode-mixed-ranks": (
        [[8, 8, 8], [16, 0, 16], [0, 0, 0], [64, 64, 64]],
        64,
        96,
        [64, 32, 32],
        [0, 1, -1, 3, 0, 1, 3, -1, 0],
    ),
    "down-rank128-prefill": ([[128], [16]], 128, 80, [48], [0] * 37 + [-1] * 5 + [1] * 20),
    "gate-up-one-adapter": ([[16, 8]], 16, 64, [40, 40], [0, 0, 0]),
    "every-row-base-but-one": ([[8], [8], [8]], 8, 32, [24], [-1, -1, 2, -1]),
}


def case(name: str, dtype: torch.dtype, device: str):
    ranks, max_rank, hidden, widths, token_slots = CASES[name]
    stack = Stack(ranks, max_rank, hidden, widths, seed=len(name)).to(dtype, device)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(len(token_slots), hidden, generator=g).to(dtype=dtype, device=device)
    out = torch.randn(len(token_slots), stack.slices[-1], generator=g).to(dtype=dtype, device=device)
    tokens, ends = (t.to(device) for t in grouped(token_slots, len(ranks)))
    return stack, x, out, tokens, ends, token_slots


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_a_loop_over_rows_and_their_adapters(name):
    stack, x, out, tokens, ends, token_slots = case(name, torch.float32, "cpu")
    expected = per_row_loop(x, out, stack, token_slots)
    shrunk = lora_shrink_reference(x, stack.a, tokens, ends)
    lora_expand_reference(shrunk, stack.b, out, tokens, ends, stack.ranks, stack.scales, stack.slices)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@DTYPES
@pytest.mark.parametrize("name", list(CASES))
def test_shrink_kernel_matches_reference(name, dtype, device, check_close):
    stack, x, _, tokens, ends, _ = case(name, dtype, device)
    expected = lora_shrink_reference(x.cpu(), stack.a.cpu(), tokens.cpu(), ends.cpu())
    check_close("lora_shrink", lora_shrink_triton(x, stack.a, tokens, ends, stack.ranks).cpu(), expected)


@DTYPES
@pytest.mark.parametrize("name", list(CASES))
def test_expand_kernel_adds_what_the_reference_adds(name, dtype, device, check_close):
    stack, x, out, tokens, ends, _ = case(name, dtype, device)
    shrunk = lora_shrink_reference(x.cpu(), stack.a.cpu(), tokens.cpu(), ends.cpu())
    expected = out.cpu().clone()
    lora_expand_reference(
        shrunk, stack.b.cpu(), expected, tokens.cpu(), ends.cpu(), stack.ranks.cpu(), stack.scales.cpu(), stack.slices
    )
    untouched = [t for t in range(out.shape[0]) if t not in set(tokens.tolist())]
    before = out[untouched].clone()
    lora_expand_triton(shrunk.to(device), stack.b, out, tokens, ends, stack.ranks, stack.scales, stack.slices)
    check_close("lora_expand", out.cpu(), expected)
    assert torch.equal(out[untouched], before)  # base rows are left exactly as they were


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host wait shows only on a CUDA device")
def test_on_cuda_the_kernels_never_wait_for_the_host():
    # A sync inside a captured decode graph fails the capture; here any sync raises.
    stack, x, out, tokens, ends, _ = case("qkv-decode-mixed-ranks", torch.bfloat16, "cuda")
    lora_expand_triton(
        lora_shrink_triton(x, stack.a, tokens, ends, stack.ranks),
        stack.b,
        out,
        tokens,
        ends,
        stack.ranks,
        stack.scales,
        stack.slices,
    )
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        shrunk = lora_shrink_triton(x, stack.a, tokens, ends, stack.ranks)
        lora_expand_triton(shrunk, stack.b, out, tokens, ends, stack.ranks, stack.scales, stack.slices)
    finally:
        torch.cuda.set_sync_debug_mode("default")
