"""The model runner: turns a step's chunks into the model's inputs and returns the logits to sample.

Under tensor parallelism rank 0's runner sends each step's host arrays to the other ranks
(`ring`, worker/engine/step_ring.py) before running it, and every rank runs `execute` on the
same arrays: the same forward over its share of the model, with the collectives inside."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from worker.engine.host_step import HostStep
from worker.engine.kv_pool import pages_for
from worker.engine.lora.rows import LoraRows
from worker.engine.page_table import PageTable
from worker.engine.request import Request
from worker.engine.scheduler import ScheduledChunk
from worker.engine.verify_graphs import is_verify_step, padded_verify_step
from worker.model.batch import KVCaches, StepInputs
from worker.model.lora import lora_slots
from worker.model.qwen3 import Qwen3ForCausalLM

if TYPE_CHECKING:
    from worker.engine.cuda_graph import DecodeGraphRunner
    from worker.engine.step_ring import StepRing
    from worker.engine.verify_graphs import VerifyGraphRunner


class ModelRunner:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        kv_caches: KVCaches,
        page_size: int,
        device: torch.device,
        page_table: PageTable | None = None,
        decode_graphs: DecodeGraphRunner | None = None,
        ring: StepRing | None = None,
        verify_graphs: VerifyGraphRunner | None = None,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.page_size = page_size
        self.device = device
        # The scheduler's, which frees a request's row with its pages; a runner driven without
        # a scheduler (the memory profile) keeps rows of its own.
        self.page_table = page_table if page_table is not None else PageTable()
        self.decode_graphs = decode_graphs  # captured at start on CUDA: decode steps replay them
        self.ring = ring  # rank 0 of a tensor-parallel group: where the other ranks read each step
        self.verify_graphs = verify_graphs  # speculative decoding's verify steps replay them on CUDA
        self.lora_slots = lora_slots(model)  # the model's LoRA adapter slots (0: it serves none)
        self._logits: torch.Tensor | None = None  # reused on CPU, see compute_logits

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], future_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Extends every chunk's KV; returns [N, vocab] float32 logits, one row per sampling chunk, in order.

        `future_tokens`: the previous step's sampled ids, still on the device, for the chunks
        whose input is a token not yet seen by the host (see worker.engine.overlap)."""
        step = self.host_step(chunks)
        if not step.has_placeholders:
            future_tokens = None
        if self.ring is not None:
            self.ring.send(step, 0 if future_tokens is None else future_tokens.shape[0])
        return self.execute(step, future_tokens)

    @torch.inference_mode()
    def execute(self, step: HostStep, future_tokens: torch.Tensor | None = None) -> torch.Tensor | None:
        """Runs one step's forward on this rank; the logits on rank 0, None on the other ranks.
        Under tensor parallelism `future_tokens` is rank 0's draws there, and where the other
        ranks receive them."""
        inputs = step.to_device(self.device)
        if future_tokens is not None:
            inputs.input_ids = resolve_future_tokens(inputs.input_ids, self.model.tp.broadcast(future_tokens))
        if self.decode_graphs is not None and self.decode_graphs.fits(inputs):
            return self.decode_graphs.run(inputs)
        if self.verify_graphs is not None and self.verify_graphs.fits(step):
            return self.verify_graphs.run(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches, inputs.lora)
        return self.compute_logits(hidden[inputs.sample_indices])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """On CPU the logits go into one buffer kept across steps (the largest seen so far).

        A step's logits are 40 MB at 64 rows of Qwen3's vocabulary: above glibc's mmap threshold,
        so a fresh tensor each step faulted in every page (about 15% of the LM head at 64 rows).
        The sampler is done with a step's logits before the next step computes its own."""
        rows = hidden.shape[0]
        reuse = self._logits is not None and self._logits.shape[0] >= rows
        logits = self.model.compute_logits(hidden, self._logits[:rows] if reuse else None)
        if self.device.type == "cpu" and not reuse:
            self._logits = logits
        return logits

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        """The step's inputs on the device."""
        return self.host_step(chunks).to_device(self.device)

    def host_step(self, chunks: list[ScheduledChunk]) -> HostStep:
        """The step's host arrays: each chunk's tokens from its request (its draft after them);
        a verify step that a graph can replay is laid out for it (worker.engine.verify_graphs)."""
        requests = [c.request for c in chunks]
        if self.verify_graphs is not None and is_verify_step(chunks):
            q = self.verify_graphs.q
            lora = self.lora_rows(requests, np.full(len(chunks), q, dtype=np.int64))
            return padded_verify_step(self.page_table, self.page_size, chunks, q, lora)
        prefix = np.array([c.start for c in chunks], dtype=np.int64)
        q_len = np.array([c.num_tokens for c in chunks], dtype=np.int64)
        if int(q_len.max()) == 1:
            token_ids = [c.request.token_ids[c.start] for c in chunks]
        else:
            token_ids = [t for c in chunks for t in c.input_ids]
        samples = [c.num_sampled for c in chunks]
        num_sampled = None if samples.count(1) == len(samples) else np.array(samples, dtype=np.int64)
        return build_host_step(
            self.page_table,
            self.page_size,
            requests,
            prefix,
            q_len,
            token_ids,
            num_sampled,
            self.lora_rows(requests, q_len),
        )

    def lora_rows(self, requests: list[Request], new_tokens: np.ndarray) -> LoraRows | None:
        """The step's tokens that run with a LoRA adapter, by slot: every token of a request on one,
        a verify step's drafted tokens included (None: no request uses one)."""
        return LoraRows.of_chunks(requests, new_tokens, self.lora_slots) if self.lora_slots else None


def build_host_step(
    page_table: PageTable,
    page_size: int,
    requests: list[Request],
    prefix: np.ndarray,
    q_len: np.ndarray,
    token_ids: list[int],
    num_sampled: np.ndarray | None = None,
    lora: LoraRows | None = None,
) -> HostStep:
    """A step extending each request by q_len tokens after its first `prefix`, in a handful of
    numpy ops (on the host, a numpy op costs a fraction of a torch op's dispatch); the page table
    is a gather of the requests' persistent rows (worker.engine.page_table). `num_sampled`: how
    many of each request's last tokens return logits (None: one each); `lora`: the tokens that run
    with an adapter."""
    seq_lens = prefix + q_len
    cu_seqlens = np.zeros(len(requests) + 1, dtype=np.int64)
    np.cumsum(q_len, out=cu_seqlens[1:])
    max_q_len = int(q_len.max())
    if max_q_len == 1:
        owner, positions = np.arange(len(requests)), prefix  # owner: the request index of each new token
    else:
        owner = np.repeat(np.arange(len(requests)), q_len)
        positions = np.arange(len(token_ids)) - cu_seqlens[owner] + prefix[owner]
    table = page_table.gather(page_table.rows_for(requests), pages_for(int(seq_lens.max()), page_size))
    slot_mapping = table[owner, positions // page_size].astype(np.int64) * page_size + positions % page_size
    return HostStep(
        np.array(token_ids, dtype=np.int64),
        positions,
        slot_mapping,
        table,
        seq_lens.astype(np.int32),
        prefix.astype(np.int32),
        cu_seqlens.astype(np.int32),
        sample_indices(cu_seqlens, num_sampled),
        max_q_len,
        lora,
    )


def sample_indices(cu_seqlens: np.ndarray, num_sampled: np.ndarray | None) -> np.ndarray:
    """The tokens whose logits the step returns: the last `num_sampled` of each request's (a
    sampling chunk's last token; every token of a chunk with a draft, each one verifying the
    token after it; none of a prefill chunk short of its sequence's end)."""
    last = cu_seqlens[1:] - 1
    if num_sampled is None:
        return last
    if num_sampled.max(initial=0) <= 1:
        return last[num_sampled.astype(bool)]
    first = np.repeat(last + 1 - num_sampled, num_sampled)  # each request's first sampled token, once per row
    within = np.arange(int(num_sampled.sum())) - np.repeat(np.cumsum(num_sampled) - num_sampled, num_sampled)
    return first + within


def resolve_future_tokens(input_ids: torch.Tensor, future_tokens: torch.Tensor) -> torch.Tensor:
    """Input id -(i + 1) stands for row i of the previous step's sampled tokens: replaced on
    the device, so the host never waits for them (SGLang's future token ids)."""
    rows = (-input_ids - 1).clamp_(min=0)
    return torch.where(input_ids < 0, future_tokens[rows], input_ids)
