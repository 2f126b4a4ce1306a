"""The per-step metadata the model runner hands to the model."""

from dataclasses import dataclass

import torch

# One (k_cache, v_cache) pair per layer, each [num_pages, page_size, num_kv_heads, head_dim].
KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class AttentionMetadata:
    """Where each token of a flattened batch of B requests reads and writes the paged KV cache.

    A decode step has exactly one new token per request. An extend step has any number
    (prefill chunks and decodes mixed); its new tokens attend causally to each other and
    to the request's cached prefix.
    """

    is_decode: bool
    slot_mapping: torch.Tensor  # [T] int64: cache slot (page * page_size + offset) of each new token
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32: cached + new tokens after this step
    prefix_lens: torch.Tensor  # [B] int32: tokens already cached before this step
    cu_seqlens_q: torch.Tensor  # [B+1] int32: offsets of each request's new tokens
    max_q_len: int


@dataclass
class LoraBatch:
    """Which rows of a step use a LoRA adapter (worker/model/lora.py): their indices grouped by
    adapter slot, and the cumulative count of each slot's rows. None in a step where no row uses one."""

    tokens: torch.Tensor  # [N] int64
    group_ends: torch.Tensor  # [slots] int32


@dataclass
class StepInputs:
    """One step's batch as the model takes it."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    sample_indices: torch.Tensor  # [N] int64: the last new token of each chunk that samples
    lora: LoraBatch | None = None
