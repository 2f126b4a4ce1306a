"""One step's inputs as host arrays: what the runner builds from the scheduled chunks, what rank 0
of a tensor-parallel group sends the other ranks (worker/engine/step_ring.py), and what every
rank turns into the model's device tensors the same way."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.lora.rows import LoraRows
from worker.engine.transfer import to_device
from worker.model.batch import AttentionMetadata, StepInputs


@dataclass
class HostStep:
    input_ids: np.ndarray  # [T] int64; negative: a token not yet on the host (worker.engine.overlap)
    positions: np.ndarray  # [T] int64
    slot_mapping: np.ndarray  # [T] int64
    page_table: np.ndarray  # [B, P] int32
    seq_lens: np.ndarray  # [B] int32
    prefix_lens: np.ndarray  # [B] int32
    cu_seqlens_q: np.ndarray  # [B + 1] int32
    sample_indices: np.ndarray  # [N] int64
    max_q_len: int
    lora: LoraRows | None = None  # the rows that use a LoRA adapter, by slot

    @property
    def has_placeholders(self) -> bool:
        return bool(self.input_ids.size) and int(self.input_ids.min()) < 0

    def to_device(self, device: torch.device) -> StepInputs:
        def upload(array: np.ndarray) -> torch.Tensor:
            return to_device(torch.from_numpy(array), device)

        meta = AttentionMetadata(
            is_decode=self.max_q_len == 1,
            slot_mapping=upload(self.slot_mapping),
            page_table=upload(self.page_table),
            seq_lens=upload(self.seq_lens),
            prefix_lens=upload(self.prefix_lens),
            cu_seqlens_q=upload(self.cu_seqlens_q),
            max_q_len=self.max_q_len,
        )
        lora = self.lora.to_device(device) if self.lora is not None else None
        return StepInputs(upload(self.input_ids), upload(self.positions), meta, upload(self.sample_indices), lora)
