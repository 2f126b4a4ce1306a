"""A step's rows grouped by LoRA adapter slot, built on the host with a few numpy ops (and sent as
such to a tensor-parallel group's other ranks)."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from worker.engine.transfer import to_device
from worker.model.batch import LoraBatch

if TYPE_CHECKING:
    from worker.engine.request import Request


class LoraRows(NamedTuple):
    """A LoraBatch on the host."""

    tokens: np.ndarray  # [N] int64
    group_ends: np.ndarray  # [slots] int32

    @classmethod
    def of(cls, sequence_slots: np.ndarray, new_tokens: np.ndarray, slots: int) -> LoraRows | None:
        """From each sequence's slot (-1: the base model) and its new tokens this step; None when
        no row uses an adapter."""
        token_slots = np.repeat(sequence_slots, new_tokens)
        used = token_slots >= 0
        count = int(used.sum())
        if count == 0:
            return None
        tokens = np.argsort(np.where(used, token_slots, slots), kind="stable")[:count]
        group_ends = np.cumsum(np.bincount(token_slots[used], minlength=slots)).astype(np.int32)
        return cls(tokens.astype(np.int64), group_ends)

    @classmethod
    def of_chunks(cls, requests: list[Request], new_tokens: np.ndarray, slots: int) -> LoraRows | None:
        """From each chunk's request's adapter slot."""
        sequence_slots = np.array([-1 if r.adapter is None else r.adapter.slot for r in requests], dtype=np.int64)
        return cls.of(sequence_slots, new_tokens, slots)

    def to_device(self, device: torch.device) -> LoraBatch:
        return LoraBatch(*(to_device(torch.from_numpy(a), device) for a in self))
