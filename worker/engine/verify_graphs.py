"""Verify steps replayed from CUDA graphs, one graph per batch size of the decode ladder.

A step of speculative decoding where every request decodes (none prefills) verifies drafts of
up to k tokens: each request extends by 1 + n tokens through the extend kernel, which reads its KV
once for all of them. Replayed eagerly, such a step launches as many kernels as a decode step, so
at small batches it would cost far more than the decode graph it stands in for. To replay one
graph per batch size, the step is laid out uniformly (`padded_verify_step`): every request gets
q = k + 1 query tokens, a shorter draft followed by padding tokens that write no KV (slot -1),
sit at the request's last real position (a position inside the RoPE table) and return no logits.
A request's real tokens never see its padding: attention is causal, and padding comes last. The
batch pads to the next captured size as decode graphs do (a padding request: q tokens at
positions 0, slots -1, reading page 0).

The extend kernel sizes its grid from q and the batch alone (kernels/extend_attention.py), so it
can be captured. Logits come for every one of the batch's q-token rows into one buffer shared by
every size; the rows that verify a real token are gathered from it. Under tensor parallelism every
rank builds the same layout from the same host arrays and replays the same size.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from worker.engine.cuda_graph import capture_sizes, describe_sizes, load_lora, padded_size
from worker.engine.host_step import HostStep
from worker.engine.kv_pool import pages_for
from worker.engine.lora.rows import LoraRows
from worker.engine.page_table import PageTable
from worker.engine.scheduler import ScheduledChunk
from worker.model.batch import AttentionMetadata, KVCaches, LoraBatch, StepInputs
from worker.model.lora import lora_slots
from worker.model.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)


def is_verify_step(chunks: list[ScheduledChunk]) -> bool:
    """Every chunk a decode (its one token is its sequence's last), and some verifying a draft."""
    return any(c.draft for c in chunks) and all(c.samples and c.num_tokens == 1 + len(c.draft) for c in chunks)


def padded_verify_step(
    page_table: PageTable, page_size: int, chunks: list[ScheduledChunk], q: int, lora: LoraRows | None = None
) -> HostStep:
    """The step's host arrays with every request at q query tokens, padding after a shorter draft;
    `lora`: the tokens that run with an adapter, counted over that layout (q per request)."""
    drafts = np.array([len(c.draft) for c in chunks], dtype=np.int64)
    starts = np.array([c.start for c in chunks], dtype=np.int64)
    tokens = np.zeros((len(chunks), q), dtype=np.int64)
    for row, chunk in zip(tokens, chunks):
        row[: chunk.num_tokens] = chunk.input_ids
    column = np.arange(q)[None, :]
    real = column <= drafts[:, None]
    positions = starts[:, None] + np.minimum(column, drafts[:, None])
    width = pages_for(int((starts + q).max()), page_size)  # padding reads keys up to start + q - 1
    table = page_table.gather(page_table.rows_for([c.request for c in chunks]), width)
    if table.shape[1] < width:
        table = np.pad(table, ((0, 0), (0, width - table.shape[1])))
    slots = table[np.arange(len(chunks))[:, None], positions // page_size].astype(np.int64) * page_size
    slots = np.where(real, slots + positions % page_size, -1)
    rows = np.arange(len(chunks) * q).reshape(len(chunks), q)
    return HostStep(
        tokens.reshape(-1),
        positions.reshape(-1),
        slots.reshape(-1),
        table,
        (starts + q).astype(np.int32),
        starts.astype(np.int32),
        (np.arange(len(chunks) + 1) * q).astype(np.int32),
        rows[real],
        q,
        lora,
    )


class VerifyBuffers:
    """The static inputs of every verify graph: requests [0, size) of each feed the graph of that
    size, q tokens each. At rest every request is padding, so a capture writes nothing."""

    def __init__(self, max_batch: int, max_pages: int, q: int, device: torch.device, lora_slots: int = 0):
        def full(*shape: int, value: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full(shape, value, dtype=dtype, device=device)

        self.q = q
        self.input_ids = full(max_batch * q, value=0, dtype=torch.int64)
        self.positions = full(max_batch * q, value=0, dtype=torch.int64)
        self.slot_mapping = full(max_batch * q, value=-1, dtype=torch.int64)
        self.page_table = full(max_batch, max_pages, value=0, dtype=torch.int32)
        self.seq_lens = full(max_batch, value=q, dtype=torch.int32)
        self.prefix_lens = full(max_batch, value=0, dtype=torch.int32)
        self.cu_seqlens_q = torch.arange(0, (max_batch + 1) * q, q, dtype=torch.int32, device=device)
        # The tokens that use a LoRA adapter, as the decode graphs hold them (worker/engine/cuda_graph.py):
        # the slots' token counts bound what the kernels read.
        self.lora = None
        if lora_slots:
            self.lora = LoraBatch(
                full(max_batch * q, value=0, dtype=torch.int64), full(lora_slots, value=0, dtype=torch.int32)
            )

    @property
    def max_pages(self) -> int:
        return self.page_table.shape[1]

    def load(self, inputs: StepInputs, size: int) -> None:
        """Requests [0, batch) take the step's inputs; requests [batch, size) become padding."""
        q, meta = self.q, inputs.meta
        b = meta.prefix_lens.shape[0]
        for buf, real, pad in (
            (self.input_ids, inputs.input_ids, 0),
            (self.positions, inputs.positions, 0),
            (self.slot_mapping, meta.slot_mapping, -1),
        ):
            buf[: b * q].copy_(real, non_blocking=True)
            buf[b * q : size * q].fill_(pad)
        self.seq_lens[:b].copy_(meta.seq_lens, non_blocking=True)
        self.seq_lens[b:size].fill_(q)
        self.prefix_lens[:b].copy_(meta.prefix_lens, non_blocking=True)
        self.prefix_lens[b:size].fill_(0)
        self.page_table[:size].zero_()
        self.page_table[:b, : meta.page_table.shape[1]].copy_(meta.page_table, non_blocking=True)
        if self.lora is not None:
            load_lora(self.lora, inputs.lora)

    def lora_rows(self, size: int) -> LoraBatch | None:
        if self.lora is None:
            return None
        return LoraBatch(self.lora.tokens[: size * self.q], self.lora.group_ends)

    def meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_decode=False,
            slot_mapping=self.slot_mapping[: size * self.q],
            page_table=self.page_table[:size],
            seq_lens=self.seq_lens[:size],
            prefix_lens=self.prefix_lens[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            max_q_len=self.q,
        )


class VerifyGraphRunner:
    """Runs a uniformly laid out verify step padded to the next captured batch size: replayed from
    its graph once `capture()` (CUDA) has run, eagerly otherwise (how the padding is checked on CPU)."""

    def __init__(
        self,
        model: Qwen3ForCausalLM,
        kv_caches: KVCaches,
        max_batch: int,
        max_pages: int,
        q: int,
        device: torch.device,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.q = q
        self.sizes = capture_sizes(max_batch)
        self.buffers = VerifyBuffers(max_batch, max_pages, q, device, lora_slots(model))
        self._graphs: dict[int, Callable[[], torch.Tensor | None]] = {}
        self._captured: dict[int, torch.Tensor | None] = {}  # each graph's hidden states for an EAGLE-3 head
        self._pool = None
        rows = max_batch * q
        self.logits = (
            torch.empty(rows, model.config.vocab_size, dtype=torch.float32, device=device)
            if model.tp.rank == 0
            else None
        )

    def fits(self, step: HostStep) -> bool:
        """A step laid out by padded_verify_step for this q, within the ladder and the buffer's width."""
        batch = step.prefix_lens.shape[0]
        return (
            step.max_q_len == self.q
            and step.input_ids.size == batch * self.q
            and padded_size(batch, self.sizes) is not None
            and step.page_table.shape[1] <= self.buffers.max_pages
        )

    @torch.inference_mode()
    def run(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of the rows that verify a real token (None on a tensor-parallel rank other than 0)."""
        size = padded_size(inputs.meta.prefix_lens.shape[0], self.sizes)
        self.buffers.load(inputs, size)
        replay = self._graphs.get(size)
        logits = replay() if replay is not None else self._forward(size)
        states = self.model.model
        if states.capture_inputs:  # the real tokens' rows, in the step's own order
            captured = self._captured[size] if replay is not None else states.captured
            states.captured = captured[inputs.sample_indices]
        return logits[inputs.sample_indices] if logits is not None else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Records a graph for every size, largest first so the smaller ones reuse its memory."""
        start = time.perf_counter()
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(size)
            self._pool = graph.pool()
            self._graphs[size] = self._replayer(graph, logits)
            self._captured[size] = self.model.model.captured
        torch.cuda.synchronize()
        log.info(
            "captured %d verify CUDA graphs (batch sizes %s, %d tokens each) in %.1fs",
            len(self.sizes),
            describe_sizes(self.sizes),
            self.q,
            time.perf_counter() - start,
        )

    @staticmethod
    def _replayer(graph: torch.cuda.CUDAGraph, logits: torch.Tensor | None) -> Callable[[], torch.Tensor | None]:
        def replay() -> torch.Tensor | None:
            graph.replay()
            return logits

        return replay

    def _forward(self, size: int) -> torch.Tensor | None:
        b, rows = self.buffers, size * self.q
        hidden = self.model(b.input_ids[:rows], b.positions[:rows], b.meta(size), self.kv_caches, b.lora_rows(size))
        return self.model.compute_logits(hidden, None if self.logits is None else self.logits[:rows])
