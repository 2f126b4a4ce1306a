"""A draft model: a smaller Qwen3 with the target's vocabulary drafts each request's next k
tokens greedily, one extend step then k - 1 decode steps over the batch.

Its KV cache has a page for every page of the target's pool, under the same page ids: a request's
pages hold its draft KV beside its target KV, so the draft needs no allocator, and each page of the
pool is sized for both models' bytes (rank_setup). The prefix cache shares pages whole, draft KV
included.

The draft KV a request's pages hold is tracked per request (DraftState): the positions that hold
its own tokens, and the drafted tokens written past them, which stay valid as far as the tokens
the request then took agree with them. Each proposal first extends the draft over the request's
tokens it lacks (its whole sequence once after admission or preemption, otherwise its last token
and the drafted one accepted past the draft's last position). Draft KV that went stale (a page
reused by the prefix cache after another request wrote it) costs acceptance only: the target
verifies every drafted token, whatever the draft computed.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from worker.engine.cuda_graph import DecodeGraphRunner
from worker.engine.kv_pool import KVCacheShape, allocate_kv_caches, kv_cache_dtype
from worker.engine.page_table import PageTable
from worker.engine.request import Request
from worker.engine.runner import ModelRunner, build_host_step
from worker.engine.sampler import greedy_tokens
from worker.engine.scheduler import ScheduledChunk
from worker.model.kv_scales import use_fp8_kv_scales
from worker.model.qwen3 import Qwen3ForCausalLM


def draft_kv_shape(model: Qwen3ForCausalLM, page_size: int, kv_dtype: str, device: torch.device) -> KVCacheShape:
    """The draft's KV per page of the pool, in the pool's dtype setting."""
    config = model.config
    dtype = kv_cache_dtype(kv_dtype, model.model.norm.weight.dtype, device)
    return KVCacheShape(config.num_hidden_layers, config.num_key_value_heads, config.head_dim, page_size, dtype)


@dataclass
class DraftState:
    pages: list[int]  # the request's page list the draft KV was written through
    computed: int = 0  # positions [0, computed) hold the draft KV of the request's own tokens
    speculated: list[int] = field(default_factory=list)  # tokens whose draft KV follows them


class DraftModelProposer:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        shape: KVCacheShape,
        num_pages: int,
        page_table: PageTable,
        device: torch.device,
        graph_shape: tuple[int, int] | None = None,
    ):
        """`graph_shape`: (the most requests, the widest page table) of the decode steps whose
        CUDA graphs to capture; None: the draft runs eagerly."""
        if shape.dtype != model.model.norm.weight.dtype:
            use_fp8_kv_scales(model)
        caches = allocate_kv_caches(shape, num_pages, device)
        graphs = None
        if graph_shape is not None:  # k - 1 of its k steps are decodes: launch-bound without a graph
            graphs = DecodeGraphRunner(model, caches, *graph_shape, device)
            graphs.capture()
        self.runner = ModelRunner(model, caches, shape.page_size, device, page_table, graphs)
        self._states: weakref.WeakKeyDictionary[Request, DraftState] = weakref.WeakKeyDictionary()

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        pass  # it drafts from the requests' tokens alone

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        states = [self._state_of(req) for req in requests]
        drafts = [[token] for token in self._catch_up(requests, states)]
        for j in range(1, max(limits)):
            going = [i for i, limit in enumerate(limits) if limit > j]
            positions = [len(requests[i].token_ids) - 1 + j for i in going]
            tokens = self._next_tokens([requests[i] for i in going], positions, [[drafts[i][-1]] for i in going])
            for i, token in zip(going, tokens):
                drafts[i].append(token)
        for req, state, draft in zip(requests, states, drafts):
            state.computed, state.speculated = len(req.token_ids), draft[:-1]
        return [draft[:limit] for draft, limit in zip(drafts, limits)]

    def _state_of(self, req: Request) -> DraftState:
        """The request's draft KV, advanced past the drafted tokens it went on to take."""
        state = self._states.get(req)
        if state is None or state.pages is not req.pages:  # new, or restarted on other pages
            state = self._states[req] = DraftState(req.pages)
        tokens = req.token_ids
        for token in state.speculated:
            if state.computed >= len(tokens) - 1 or tokens[state.computed] != token:
                break
            state.computed += 1
        state.speculated = []
        return state

    def _catch_up(self, requests: list[Request], states: list[DraftState]) -> list[int]:
        """Extends the draft over each request's tokens it lacks, its last one included; the
        token the draft puts after each."""
        starts = [s.computed for s in states]
        return self._next_tokens(requests, starts, [r.token_ids[s:] for r, s in zip(requests, starts)])

    def _next_tokens(self, requests: list[Request], starts: list[int], tokens: list[list[int]]) -> list[int]:
        """Runs the draft over `tokens[i]` at positions from `starts[i]`; each request's greedy next token."""
        q_len = np.array([len(t) for t in tokens], dtype=np.int64)
        step = build_host_step(
            self.runner.page_table,
            self.runner.page_size,
            requests,
            np.array(starts, dtype=np.int64),
            q_len,
            [t for ts in tokens for t in ts],
        )
        return greedy_tokens(self.runner.execute(step)).tolist()
