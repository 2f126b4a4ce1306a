"""Decode steps replayed from CUDA graphs, one graph per batch size of a ladder.

A decode step's kernels are small and many (a few per layer), so at small batches launching
them costs more than running them. A graph captured once per batch size replays the whole
forward, logits included, with one launch. Graphs fix their tensors' addresses and shapes,
so every input lives in a static buffer sized for the largest rung, and a batch runs padded
to the next captured size. Prefill and extend steps vary too much in shape and run eagerly.

A padded row is made harmless rather than skipped: slot -1 (store_kv writes nothing), a
context of one key in page 0 (read, never written, and finite because caches start zeroed
and only ever hold K/V), input id 0 at position 0. Its logits row is sliced off.

A model that serves LoRA adapters captures its adapter kernels too, reading the rows' slots from
static buffers: a step with no adapter rows runs them over no rows (their programs return at once).

Captured kernels must not sync with the host or choose launch grids from tensor values:
the decode path (kernels/decode_attention.py) sizes its grid from shapes only (batch, kv
heads, and a split count from the page table's width, which the static buffer fixes).

Under tensor parallelism every rank captures the same ladder, in the same order, with the
forward's collectives (NCCL all-reduces, the logits' gather) inside each graph, as vLLM and
SGLang capture theirs; every rank replays the same size for a step, since each computes it
from the same inputs. Only rank 0's graphs produce logits.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from worker.model.batch import AttentionMetadata, KVCaches, LoraBatch, StepInputs
from worker.model.lora import lora_slots
from worker.model.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)

LADDER_STEP = 16  # above 8, one graph per multiple of this (as vLLM and SGLang capture)


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16, up to and always including max_batch."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch]
    sizes += range(LADDER_STEP, max_batch + 1, LADDER_STEP)
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def padded_size(batch: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds `batch` rows; None past the largest."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


class DecodeBuffers:
    """The static inputs of every decode graph: rows [0, size) of each feed the graph of that size.

    At rest every row is a padding row, so a capture (which runs the forward) writes nothing.
    """

    def __init__(self, max_batch: int, max_pages: int, device: torch.device, lora_slots: int = 0):
        def full(*shape: int, value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        self.input_ids = full(max_batch, value=0, dtype=torch.int64)
        self.positions = full(max_batch, value=0, dtype=torch.int64)
        self.slot_mapping = full(max_batch, value=-1, dtype=torch.int64)
        self.page_table = full(max_batch, max_pages, value=0, dtype=torch.int32)
        self.seq_lens = full(max_batch, value=1, dtype=torch.int32)
        self.prefix_lens = full(max_batch, value=0, dtype=torch.int32)
        # One new token per row, padding rows too: the offsets never change.
        self.cu_seqlens_q = torch.arange(max_batch + 1, dtype=torch.int32, device=device)
        # The rows that use a LoRA adapter (worker/model/batch.py's LoraBatch); the slots' row
        # counts bound what the kernels read, so stale rows past them are never used.
        self.lora = None
        if lora_slots:
            self.lora = LoraBatch(
                full(max_batch, value=0, dtype=torch.int64), full(lora_slots, value=0, dtype=torch.int32)
            )

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def load(self, inputs: StepInputs, size: int) -> None:
        """Rows [0, batch) take the step's inputs; rows [batch, size) become padding rows."""
        b, meta = inputs.input_ids.shape[0], inputs.meta
        for buf, real, pad in (
            (self.input_ids, inputs.input_ids, 0),
            (self.positions, inputs.positions, 0),
            (self.slot_mapping, meta.slot_mapping, -1),
            (self.seq_lens, meta.seq_lens, 1),
            (self.prefix_lens, meta.prefix_lens, 0),
        ):
            buf[:b].copy_(real, non_blocking=True)
            buf[b:size].fill_(pad)
        # Columns past the step's widest row are zeroed too: a row's context bounds what it
        # reads, but stale page ids would make the buffer's contents depend on history.
        self.page_table[:size].zero_()
        self.page_table[:b, : meta.page_table.shape[1]].copy_(meta.page_table, non_blocking=True)
        if self.lora is not None:
            load_lora(self.lora, inputs.lora)

    def lora_rows(self, size: int) -> LoraBatch | None:
        if self.lora is None:
            return None
        return LoraBatch(self.lora.tokens[:size], self.lora.group_ends)

    def meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_decode=True,
            slot_mapping=self.slot_mapping[:size],
            page_table=self.page_table[:size],
            seq_lens=self.seq_lens[:size],
            prefix_lens=self.prefix_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_q_len=1,
        )


class DecodeGraphRunner:
    """Runs a decode step padded to the next captured batch size.

    `capture()` (CUDA) records one graph per size; `run` then replays it. Uncaptured, each
    size runs the very forward a graph would replay, eagerly: how the padding is checked on
    CPU, where graphs do not exist.
    """

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        kv_caches: KVCaches,
        max_batch: int,
        max_pages: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = capture_sizes(max_batch)
        self.buffers = DecodeBuffers(max_batch, max_pages, device, lora_slots(model))
        self._graphs: dict[int, Callable[[], torch.Tensor | None]] = {}
        self._captured: dict[int, torch.Tensor | None] = {}  # each graph's hidden states for an EAGLE-3 head
        self._pool = None  # the memory pool all graphs share: they never run at once
        # Every size's logits are rows of this one buffer, on the rank that samples. A buffer per graph
        # held most of the 1,426 MiB that 20 graphs took on an H200 (qwen3-0.6b, batch 256). Sharing is
        # safe as one size's buffer always was between steps: a step's sampling reads its logits on
        # the stream before the next replay writes them.
        self.logits = (
            torch.empty(max_batch, model.config.vocab_size, dtype=torch.float32, device=device)
            if model.tp.rank == 0
            else None
        )

    def fits(self, inputs: StepInputs) -> bool:
        """A decode step whose rows all sample, no more of them than the largest size, and
        page tables no wider than the buffer's."""
        meta, b = inputs.meta, inputs.input_ids.shape[0]
        return (
            meta.is_decode
            and inputs.sample_indices.shape[0] == b
            and padded_size(b, self.sizes) is not None
            and meta.page_table.shape[1] <= self.buffers.max_pages
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """[batch, vocab] float32 logits of a step that `fits` (None on a tensor-parallel rank other than 0)."""
        b = inputs.input_ids.shape[0]
        size = padded_size(b, self.sizes)
        self.buffers.load(inputs, size)
        replay = self._graphs.get(size)
        logits = replay() if replay is not None else self._forward(size)
        states = self.model.model
        if states.capture_inputs:
            states.captured = (self._captured[size] if replay is not None else states.captured)[:b]
        return logits[:b] if logits is not None else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Records a graph for every size, largest first so the smaller ones reuse its memory."""
        free_before = torch.cuda.mem_get_info(self.buffers.input_ids.device)[0]
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._graphs[size] = self._capture(size)
            self._captured[size] = self.model.model.captured
        torch.cuda.synchronize()
        free_after = torch.cuda.mem_get_info(self.buffers.input_ids.device)[0]
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1fs; they hold %.0f MiB",
            len(self.sizes),
            describe_sizes(self.sizes),
            time.perf_counter() - start,
            (free_before - free_after) / 2**20,
        )

    def _capture(self, size: int) -> Callable[[], torch.Tensor | None]:
        self._forward(size)  # warm-up: Triton compiles and autotunes outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(size)
        self._pool = graph.pool()

        def replay() -> torch.Tensor | None:
            graph.replay()
            return logits

        return replay

    def _forward(self, size: int) -> torch.Tensor | None:
        b = self.buffers
        hidden = self.model(b.input_ids[:size], b.positions[:size], b.meta(size), self.kv_caches, b.lora_rows(size))
        return self.model.compute_logits(hidden, None if self.logits is None else self.logits[:size])


def load_lora(buffers: LoraBatch, lora: LoraBatch | None) -> None:
    """A graph's static LoRA rows take the step's; a step with none leaves every slot without rows."""
    if lora is None:
        buffers.group_ends.zero_()
        return
    n = lora.tokens.shape[0]
    buffers.tokens[:n].copy_(lora.tokens, non_blocking=True)
    buffers.group_ends.copy_(lora.group_ends, non_blocking=True)


def describe_sizes(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 4 else ", ".join(map(str, sizes))
