"""The fused MoE: the expert-sorted pair layout, and the two grouped GEMMs, against transformers'
per-expert loop (fused_moe_per_expert_loop). Routings include experts no token chose, a token
routed to one expert twice, every token on one expert, and batches large enough for every block
size the launcher picks."""

import pytest
import torch

from kernels.fused_moe import (
    fused_moe_per_expert_loop,
    fused_moe_reference,
    fused_moe_triton,
    tile_config,
)
from kernels.moe_align import align_by_expert_reference, align_by_expert_triton, max_padded_pairs

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def random_routing(tokens: int, top_k: int, experts: list[int], seed: int, dtype=torch.float32, device="cpu"):
    """(weights [T, k], ids [T, k]) drawn from `experts` with replacement: ids may repeat in a row."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor(experts)
    ids = pool[torch.randint(0, len(experts), (tokens, top_k), generator=g)]
    weights = torch.rand(tokens, top_k, generator=g)
    return weights.to(dtype=dtype, device=device), ids.to(device)


def topk_routing(tokens: int, top_k: int, num_experts: int, seed: int, dtype=torch.float32, device="cpu"):
    """A router's routing: the top-k of a softmax, k distinct experts per token."""
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.softmax(torch.randn(tokens, num_experts, generator=g) * 2, -1).topk(top_k)
    return weights.to(dtype=dtype, device=device), ids.to(device)


def expert_weights(num_experts: int, hidden: int, inter: int, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden**-0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) * inter**-0.5
    return w13.to(dtype=dtype, device=device), w2.to(dtype=dtype, device=device)


def hidden_states(tokens: int, hidden: int, seed: int, dtype=torch.float32, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hidden, generator=g) * 2).to(dtype=dtype, device=device)


# (tokens, top_k, experts to draw from, num_experts): experts 1 and 4 of 6 get nothing; one
# token; every pair on expert 3; a top-k as wide as the experts; Qwen3-30B-A3B's 128 experts
# and top-8, half of them unused.
ALIGN_CASES = [
    (5, 2, [0, 2, 3, 5], 6),
    (1, 1, [3], 4),
    (37, 3, [3], 8),
    (64, 4, [0, 1, 2, 3], 4),
    (40, 8, list(range(64)), 128),
]


@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[3]}")
def test_alignment_matches_the_reference(case, block_m, device):
    tokens, top_k, experts, num_experts = case
    _, ids = random_routing(tokens, top_k, experts, seed=tokens, device=device)
    got = align_by_expert_triton(ids, num_experts, block_m)
    want = align_by_expert_reference(ids.cpu(), num_experts, block_m)
    for name, a, b in zip(("sorted_pairs", "expert_ids", "num_padded"), got[:3], want[:3]):
        assert torch.equal(a.cpu(), b), name


@pytest.mark.parametrize("case", ALIGN_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[3]}")
def test_each_block_holds_one_experts_pairs_in_order_and_every_pair_appears_once(case, device):
    tokens, top_k, experts, num_experts = case
    block_m = 16
    _, ids = random_routing(tokens, top_k, experts, seed=tokens + 1, device=device)
    blocks = align_by_expert_triton(ids, num_experts, block_m)
    flat, num_pairs = ids.flatten().cpu(), ids.numel()
    pairs, block_experts = blocks.sorted_pairs.cpu(), blocks.expert_ids.cpu()
    used = int(blocks.num_padded)
    counts = torch.bincount(flat, minlength=num_experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert sorted(pairs[pairs < num_pairs].tolist()) == list(range(num_pairs))
    assert torch.all(pairs[used:] == num_pairs) and torch.all(block_experts[used // block_m :] == -1)
    for b in range(used // block_m):
        block = pairs[b * block_m : (b + 1) * block_m]
        real = block[block < num_pairs]
        assert len(real) > 0, "an expert with no pairs took a block"
        assert torch.all(flat[real.long()] == block_experts[b])
        assert real.tolist() == sorted(real.tolist())
        assert torch.all(block[len(real) :] == num_pairs), "padding sits only at the end of an expert's run"


def test_the_layout_shape_depends_on_the_batch_alone(device):
    # What lets one CUDA graph replay any routing: only the entries in use differ.
    spread = align_by_expert_triton(random_routing(24, 4, list(range(16)), seed=1, device=device)[1], 16, 16)
    packed = align_by_expert_triton(random_routing(24, 4, [7], seed=1, device=device)[1], 16, 16)
    assert [t.shape for t in spread[:3]] == [t.shape for t in packed[:3]]
    assert spread.sorted_pairs.numel() == max_padded_pairs(96, 16, 16) == 96 + 16 * 15
    assert int(packed.num_padded) == 96 < int(spread.num_padded)


def check_against_loop(check_close, got, hidden, w13, w2, weights, ids):
    want = fused_moe_per_expert_loop(hidden.cpu(), w13.cpu(), w2.cpu(), weights.cpu(), ids.cpu())
    assert got.shape == hidden.shape and got.dtype == hidden.dtype
    check_close("fused_moe", got.cpu(), want)


@DTYPES
@pytest.mark.parametrize(
    "case",
    [
        (1, 2, [0, 5], 6),  # one token
        (5, 2, [0, 2, 3, 5], 6),  # experts 1 and 4 get no token; a token may pick one expert twice
        (37, 3, [3], 8),  # every pair on one expert: a run of several blocks
        (23, 4, list(range(4)), 4),  # top-k as wide as the experts
    ],
    ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[3]}",
)
def test_fused_moe_matches_the_per_expert_loop(case, dtype, device, check_close):
    tokens, top_k, experts, num_experts = case
    hidden = hidden_states(tokens, 48, seed=tokens, dtype=dtype, device=device)  # 48, 40: not multiples of a tile
    w13, w2 = expert_weights(num_experts, 48, 40, seed=2, dtype=dtype, device=device)
    weights, ids = random_routing(tokens, top_k, experts, seed=3, dtype=dtype, device=device)
    check_against_loop(check_close, fused_moe_triton(hidden, w13, w2, weights, ids), hidden, w13, w2, weights, ids)


@DTYPES
@pytest.mark.parametrize("tokens, block_m", [(9, 16), (90, 32), (200, 64)])
def test_fused_moe_matches_the_loop_at_every_block_size(tokens, block_m, dtype, device, check_close):
    weights, ids = topk_routing(tokens, 2, 3, seed=tokens, dtype=dtype, device=device)
    assert tile_config(ids.numel(), 3, dtype).block_m == block_m
    hidden = hidden_states(tokens, 64, seed=5, dtype=dtype, device=device)
    w13, w2 = expert_weights(3, 64, 32, seed=6, dtype=dtype, device=device)
    check_against_loop(check_close, fused_moe_triton(hidden, w13, w2, weights, ids), hidden, w13, w2, weights, ids)


def test_fused_moe_of_no_tokens_is_empty(device):
    hidden = hidden_states(0, 32, seed=0, device=device)
    w13, w2 = expert_weights(4, 32, 16, seed=0, device=device)
    ids = torch.empty(0, 2, dtype=torch.int64, device=device)
    assert fused_moe_triton(hidden, w13, w2, torch.empty(0, 2, device=device), ids).shape == (0, 32)


@DTYPES
@pytest.mark.parametrize(
    "case",
    [(1, 2, [0, 5], 6), (5, 2, [0, 2, 3, 5], 6), (37, 3, [3], 8), (200, 2, [0, 1, 2], 3)],
    ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[3]}",
)
def test_the_cpu_path_matches_the_per_expert_loop(case, dtype, check_close):
    tokens, top_k, experts, num_experts = case
    hidden = hidden_states(tokens, 48, seed=tokens, dtype=dtype)
    w13, w2 = expert_weights(num_experts, 48, 40, seed=2, dtype=dtype)
    weights, ids = random_routing(tokens, top_k, experts, seed=3, dtype=dtype)
    check_against_loop(check_close, fused_moe_reference(hidden, w13, w2, weights, ids), hidden, w13, w2, weights, ids)


def test_decode_batches_take_16_pair_blocks_and_prefill_64():
    # Qwen3-30B-A3B: 128 experts, 8 per token.
    assert [tile_config(t * 8, 128, torch.bfloat16).block_m for t in (1, 64, 256, 1024, 8192)] == [16, 16, 16, 32, 64]
