"""The EAGLE-3 proposer: a one-layer head drafts from the target's own hidden states.

Each target step leaves the hidden states of three of its layers for every token it ran (the
model captures them: worker/model/qwen3.py); the speculator hands the step's chunks to `observe`.
At the next proposal, once the step's tokens are read, the head first runs over the positions
of that step whose KV the request kept (its prefill chunks, its accepted tokens): at position p it
reads the token after it and fc over the target's states there, and writes its own KV at p, in
the pool's pages (one layer's worth per page, beside the target's). The output at a request's
last such position, p = len - 2, drafts the token after its last one; each further drafted
token comes from a decode step of the head at the next position, fed its own previous output.

Those later positions' head KV is written over by the next catch-up with the target's states. A
position the head never ran on (a step without speculation, a prefix found in the cache) keeps
whatever KV its page held: it costs acceptance, never output, since the target verifies every
drafted token. A request whose last position was not in the observed step gets no draft this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker.engine.kv_pool import KVCacheShape, allocate_kv_caches
from worker.engine.page_table import PageTable
from worker.engine.request import Request
from worker.engine.runner import build_host_step
from worker.engine.scheduler import ScheduledChunk
from worker.model.eagle3 import Eagle3Head
from worker.model.qwen3 import Qwen3ForCausalLM


@dataclass
class ObservedStep:
    chunks: list[tuple[Request, int, int, int]]  # (request, first position, tokens, its first row)
    hidden: torch.Tensor  # [T, 3 * target hidden]: the captured layers' states of the step's tokens


@dataclass
class Drafting:
    requests: list[Request]
    positions: list[int]  # where each one's next head step runs
    features: torch.Tensor  # [R, hidden]: the head's output at the position before


class Eagle3Proposer:
    def __init__(
        self,
        head: Eagle3Head,
        target: Qwen3ForCausalLM,
        shape: KVCacheShape,
        num_pages: int,
        page_table: PageTable,
        device: torch.device,
    ):
        self.head = head
        self.target = target
        self.kv_cache = allocate_kv_caches(shape, num_pages, device)[0]
        self.page_size = shape.page_size
        self.page_table = page_table
        self.device = device
        self._observed: ObservedStep | None = None

    def observe(self, chunks: list[ScheduledChunk]) -> None:
        """The target step just run: its chunks, and the states its forward captured."""
        rows = np.cumsum([0] + [c.num_tokens for c in chunks])
        observed = [(c.request, c.start, c.num_tokens, int(row)) for c, row in zip(chunks, rows)]
        self._observed = ObservedStep(observed, self.target.model.captured)

    @torch.inference_mode()
    def propose(self, requests: list[Request], limits: list[int]) -> list[list[int]]:
        last = self._catch_up()
        drafts: list[list[int]] = [[] for _ in requests]
        going = [i for i, req in enumerate(requests) if req in last]
        if not going:
            return drafts
        drafting = Drafting(
            [requests[i] for i in going],
            [len(requests[i].token_ids) - 1 for i in going],
            torch.stack([last[requests[i]] for i in going]),
        )
        for j in range(max(limits[i] for i in going)):
            tokens = self.head.greedy_tokens(drafting.features).tolist()
            for i, token in zip(going, tokens):
                drafts[i].append(token)
            keep = [n for n, i in enumerate(going) if limits[i] > j + 1]
            if not keep:
                break
            drafting = self._step(drafting, tokens, keep)
            going = [going[n] for n in keep]
        return drafts

    def _step(self, drafting: Drafting, tokens: list[int], keep: list[int]) -> Drafting:
        """A decode step of the head for the requests at `keep`: each reads its drafted token."""
        requests = [drafting.requests[n] for n in keep]
        positions = [drafting.positions[n] for n in keep]
        out = self._run(requests, positions, [[tokens[n]] for n in keep], drafting.features[keep])
        return Drafting(requests, [p + 1 for p in positions], out)

    def _catch_up(self) -> dict[Request, torch.Tensor]:
        """Runs the head over the observed step's kept positions; each request's output at its
        last one, for the requests whose last one is the position before their last token."""
        observed, self._observed = self._observed, None
        if observed is None:
            return {}
        requests, starts, tokens, rows = [], [], [], []
        for req, start, num_tokens, row in observed.chunks:
            n = self.kept_positions(req, start, num_tokens)
            if n > 0:
                requests.append(req)
                starts.append(start)
                tokens.append(req.token_ids[start + 1 : start + 1 + n])
                rows.extend(range(row, row + n))
        if not requests:
            return {}
        features = self.head.features(observed.hidden[torch.tensor(rows, device=self.device)])
        out = self._run(requests, starts, tokens, features)
        ends = np.cumsum([len(t) for t in tokens]) - 1
        return {
            req: out[end]
            for req, start, t, end in zip(requests, starts, tokens, ends)
            if start + len(t) == len(req.token_ids) - 1
        }

    @staticmethod
    def kept_positions(req: Request, start: int, num_tokens: int) -> int:
        """How many of the step's positions from `start` the request kept (their KV is its own)
        and knows the token after (no placeholder in flight)."""
        if req.is_finished or not req.params.speculative:
            return 0
        n = min(num_tokens, req.num_computed_tokens - start, len(req.token_ids) - 1 - start)
        while n > 0 and req.token_ids[start + n] < 0:
            n -= 1
        return n

    def _run(
        self, requests: list[Request], starts: list[int], tokens: list[list[int]], features: torch.Tensor
    ) -> torch.Tensor:
        """The head over `tokens[i]` at positions from `starts[i]`, reading `features` row by row."""
        step = build_host_step(
            self.page_table,
            self.page_size,
            requests,
            np.array(starts, dtype=np.int64),
            np.array([len(t) for t in tokens], dtype=np.int64),
            [t for ts in tokens for t in ts],
        )
        inputs = step.to_device(self.device)
        return self.head(inputs.input_ids, features, inputs.positions, inputs.meta, self.kv_cache)
