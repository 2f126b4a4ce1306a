"""A test harness that drives Qwen3ForCausalLM over a paged KV cache without the engine.

It keeps, per sequence, its token count and page list, and builds the AttentionMetadata of an
extend step (any number of new tokens per sequence) or a decode step (one each). Pages are
handed out from a shuffled free list so a sequence's pages are never contiguous.
"""

import random

import torch

from worker.model.batch import AttentionMetadata, LoraBatch
from worker.model.qwen3 import Qwen3ForCausalLM


class PagedModelRunner:
    """`cache_dtype` defaults to the model's; a float8 cache needs the model's kv scales set
    (worker.model.kv_scales)."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        num_pages: int = 128,
        page_size: int = 4,
        seed: int = 0,
        cache_dtype: torch.dtype | None = None,
    ):
        config, dtype = model.config, cache_dtype or model.model.norm.weight.dtype
        self.device = model.model.norm.weight.device
        shape = (num_pages, page_size, config.num_key_value_heads, config.head_dim)
        self.model = model
        self.page_size = page_size
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device), torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(config.num_hidden_layers)
        ]
        self.free_pages = list(range(num_pages))
        random.Random(seed).shuffle(self.free_pages)
        self.lens: list[int] = []
        self.pages: list[list[int]] = []

    def add_sequence(self) -> int:
        self.lens.append(0)
        self.pages.append([])
        return len(self.lens) - 1

    @torch.inference_mode()
    def extend(self, chunks: dict[int, list[int]], lora: LoraBatch | None = None) -> list[torch.Tensor]:
        """Append each sequence's new tokens in one step; returns each chunk's logits [len, vocab].
        `lora`: which rows use which LoRA adapter slot."""
        logits = self.step(chunks, is_decode=False, lora=lora)
        return list(logits.split([len(c) for c in chunks.values()]))

    @torch.inference_mode()
    def decode(self, tokens: dict[int, int], lora: LoraBatch | None = None) -> torch.Tensor:
        """One new token per sequence; returns logits [B, vocab] in the order given."""
        return self.step({seq: [tok] for seq, tok in tokens.items()}, is_decode=True, lora=lora)

    def step(self, chunks: dict[int, list[int]], is_decode: bool, lora: LoraBatch | None = None) -> torch.Tensor:
        seqs = list(chunks)
        positions = [range(self.lens[s], self.lens[s] + len(chunks[s])) for s in seqs]
        for s, pos in zip(seqs, positions):
            self.reserve_pages(s, pos.stop)
        meta = self.metadata(seqs, positions, is_decode)
        input_ids = torch.tensor([t for s in seqs for t in chunks[s]], dtype=torch.int64, device=self.device)
        flat_positions = torch.tensor([p for pos in positions for p in pos], dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, flat_positions, meta, self.kv_caches, lora)
        for s, pos in zip(seqs, positions):
            self.lens[s] = pos.stop
        return self.model.compute_logits(hidden)

    def reserve_pages(self, seq: int, length: int) -> None:
        while len(self.pages[seq]) * self.page_size < length:
            self.pages[seq].append(self.free_pages.pop())

    def metadata(self, seqs: list[int], positions: list[range], is_decode: bool) -> AttentionMetadata:
        ps = self.page_size
        slots = [self.pages[s][p // ps] * ps + p % ps for s, pos in zip(seqs, positions) for p in pos]
        max_pages = max(len(self.pages[s]) for s in seqs)
        table = [self.pages[s] + [0] * (max_pages - len(self.pages[s])) for s in seqs]
        q_lens = [len(pos) for pos in positions]
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        return AttentionMetadata(
            is_decode=is_decode,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            page_table=torch.tensor(table, dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([pos.stop for pos in positions], dtype=torch.int32, device=self.device),
            prefix_lens=torch.tensor([pos.start for pos in positions], dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=self.device),
            max_q_len=max(q_lens),
        )
