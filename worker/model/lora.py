"""LoRA adapters on the model: a fixed number of slots in every projection an adapter may target,
and the per-step batch that says which rows use which slot.

Each of a layer's four projections (qkv_proj, o_proj, gate_up_proj, down_proj) gets a LoraStack:
every slot's A and B for each slice of the projection (q, k, v of the fused qkv; gate, up of the
fused gate_up), padded to the largest rank with zeros, with each slot's ranks and scales per slice
(lora_alpha / r, or / sqrt(r) for rsLoRA; peft's rank_pattern and alpha_pattern give modules ranks
and scales of their own). A slot an adapter leaves a slice out of has rank 0 there. The stacks are
buffers at fixed addresses, written in place when an adapter is installed in a slot, so captured
CUDA graphs read whatever the slots hold.

The projection adds `scale * B (A x)` to its base output for the rows of the step that use an
adapter (kernels.lora_shrink, lora_expand): a step with none costs nothing.

Under tensor parallelism adapters shard like their base layers (as in vLLM and S-LoRA): a
column-parallel projection (qkv, gate_up) keeps A whole and this rank's rows of B; a row-parallel
one (o, down) this rank's columns of A and B whole, so its update is a partial sum like its base
output, completed by the same all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

import kernels
from kernels.lora_shrink import block_m_for
from worker.model.batch import LoraBatch
from worker.model.loader import split_columns, split_rows

# Our projections and the PEFT target modules stacked in them, in row order.
PROJECTIONS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
PARENTS = {"qkv_proj": "self_attn", "o_proj": "self_attn", "gate_up_proj": "mlp", "down_proj": "mlp"}


class LoraStack(nn.Module):
    """One projection's adapter slots: A [slots, n * R, in], B [slots, out, R], ranks and scales
    [slots, n]. Slice s of a slot holds its rank's rows of A at [s * R, s * R + rank) and its B in
    columns [0, rank) of the slice's rows; everything past a rank is zero."""

    def __init__(self, slots: int, max_rank: int, in_features: int, widths: list[int], dtype: torch.dtype):
        super().__init__()
        n = len(widths)
        self.max_rank = max_rank
        self.slices = tuple(int(x) for x in np.cumsum([0, *widths]))  # output column offsets, and the end
        self.register_buffer("a", torch.zeros(slots, n * max_rank, in_features, dtype=dtype), persistent=False)
        self.register_buffer("b", torch.zeros(slots, self.slices[-1], max_rank, dtype=dtype), persistent=False)
        self.register_buffer("ranks", torch.zeros(slots, n, dtype=torch.int32), persistent=False)
        self.register_buffer("scales", torch.zeros(slots, n, dtype=torch.float32), persistent=False)

    def install(self, slot: int, parts: dict[int, SliceWeights]) -> None:
        """Slot `slot` holds the adapter whose slices `parts` gives (the others: rank 0). Copies
        from pinned host memory are queued on the device's stream, behind the steps already queued."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        # Pinned: a copy from pageable memory would wait for the steps queued before it.
        pin = self.ranks.is_cuda
        ranks = torch.zeros(len(self.slices) - 1, dtype=torch.int32, pin_memory=pin)
        scales = torch.zeros(len(self.slices) - 1, dtype=torch.float32, pin_memory=pin)
        for s, part in parts.items():
            r = part.a.shape[0]
            self.a[slot, s * self.max_rank : s * self.max_rank + r].copy_(part.a, non_blocking=True)
            self.b[slot, self.slices[s] : self.slices[s + 1], :r].copy_(part.b, non_blocking=True)
            ranks[s], scales[s] = r, part.scale
        self.ranks[slot].copy_(ranks, non_blocking=True)
        self.scales[slot].copy_(scales, non_blocking=True)

    def add_update(self, out: torch.Tensor, x: torch.Tensor, batch: LoraBatch) -> None:
        """out += each listed row's adapter update of x."""
        with one_thread_on_cpu(x):
            shrunk = kernels.lora_shrink(x, self.a, batch.tokens, batch.group_ends, self.ranks)
            kernels.lora_expand(
                shrunk, self.b, out, batch.tokens, batch.group_ends, self.ranks, self.scales, self.slices
            )


@contextmanager
def one_thread_on_cpu(x: torch.Tensor) -> Iterator[None]:
    """On CPU, torch's other threads sit out the block: an adapter update is dozens of products of a
    few rows each, whose parallel regions cost more than they save, and on a busy machine each waits
    for the other threads' time slices (measured in bench/RESULTS.md, "LoRA adapters")."""
    threads = torch.get_num_threads()
    if x.device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class SliceWeights(NamedTuple):
    """One target module of an adapter, as this rank holds it: A [r, in], B [out, r], its scale."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


class LoraTarget(NamedTuple):
    """Where one PEFT target module goes: a slice of a stack; A's and B's whole shapes, and the
    share of them this rank holds (A's columns, B's rows)."""

    stack: LoraStack
    slice: int
    in_features: int
    out_features: int
    a_cols: range
    b_rows: range


@torch.inference_mode()
def warm_up_lora(model: nn.Module, max_tokens: int) -> None:
    """Runs each projection shape's update once at each row count that picks another block size
    (kernels/lora_shrink.py's block_m_for), up to a step of max_tokens rows: every LoRA kernel variant
    serving launches is compiled before a job waits for it (decode graphs compile theirs as they
    capture). All rows on slot 0, whatever it holds: a kernel compiles whether or not its programs
    find work. Nothing is written but the scratch output."""
    shapes = {}
    for stack in (m for m in model.modules() if isinstance(m, LoraStack)):
        shapes.setdefault((stack.a.shape, stack.b.shape, stack.slices), stack)
    for stack in shapes.values():
        slots, _, in_features = stack.a.shape
        for rows in warm_up_row_counts(max_tokens, slots):
            x = torch.zeros(rows, in_features, dtype=stack.a.dtype, device=stack.a.device)
            out = torch.zeros(rows, stack.slices[-1], dtype=stack.a.dtype, device=stack.a.device)
            tokens = torch.arange(rows, device=stack.a.device)
            ends = torch.full((slots,), rows, dtype=torch.int32, device=stack.a.device)
            stack.add_update(out, x, LoraBatch(tokens, ends))


def warm_up_row_counts(max_tokens: int, slots: int) -> list[int]:
    """The fewest rows that pick each block size a step of up to max_tokens rows can."""
    counts, seen = [], set()
    for rows in range(1, max_tokens + 1):
        block = block_m_for(rows, slots)
        if block not in seen:
            seen.add(block)
            counts.append(rows)
    return counts


def lora_slots(model: nn.Module) -> int:
    """The adapter slots attach_lora gave `model` (0: it serves no adapters)."""
    stack = next((m for m in model.modules() if isinstance(m, LoraStack)), None)
    return 0 if stack is None else stack.a.shape[0]


def attach_lora(model: nn.Module, slots: int, max_rank: int) -> dict[str, LoraTarget]:
    """Gives every projection of `model` (a Qwen3ForCausalLM) a LoraStack of `slots` slots, and
    returns each PEFT target module name (model.layers.0.self_attn.q_proj) it can take."""
    config, tp = model.config, model.tp
    dtype = model.model.norm.weight.dtype
    fused, row_parallel = split_rows(config, tp), split_columns(config, tp)
    targets = {}
    for i, layer in enumerate(model.model.layers):
        for proj, parts in PROJECTIONS.items():
            linear = getattr(getattr(layer, PARENTS[proj]), proj, None)
            if linear is None:
                continue  # a mixture of experts' sparse MLP: its experts take no adapter
            out_local, in_local = linear.weight.shape
            with torch.device(linear.weight.device):
                if proj in fused:
                    shares = fused[proj]
                    stack = LoraStack(slots, max_rank, in_local, [len(mine) for _, _, mine in shares], dtype)
                    for s, (name, rows, mine) in enumerate(shares):
                        target = LoraTarget(stack, s, in_local, rows, range(in_local), mine)
                        targets[f"model.layers.{i}.{PARENTS[proj]}.{name}"] = target
                else:
                    cols, mine = row_parallel[proj]
                    stack = LoraStack(slots, max_rank, in_local, [out_local], dtype)
                    target = LoraTarget(stack, 0, cols, out_local, mine, range(out_local))
                    targets[f"model.layers.{i}.{PARENTS[proj]}.{parts[0]}"] = target
            linear.lora = stack
    return targets
