"""Overlapped scheduling: the host prepares step N+1 while the device runs step N.

Without it, every step ends with the host waiting for the step's tokens, then checking
stops, building outputs, scheduling and preparing the next step, and (in the worker) talking
to Redis, all while the device idles. Overlapped (SGLang's overlap scheduler), one
`Engine.step()` call

  1. schedules step N and launches it: the model, the sampler, and a copy of the draws into
     pinned host memory are queued on the device, and an event marks when the copy lands;
  2. reads step N-1's draws, which landed while the host did 1, and turns them into outputs;
  3. returns step N-1's outputs. The caller publishes them and reads new jobs while the
     device runs step N, and its next call queues step N+1 behind N.

A token drawn in step N-1 is step N's input before the host has seen it. The request's
token list holds a placeholder for it, -(row + 1), `row` being the request's row in step
N-1's draws; the runner swaps placeholders for those draws on the device
(runner.resolve_future_tokens). Reading step N-1 puts the real token in its place.

What the lag changes, none of it visible in outputs:
- A request whose token in flight is its last by length (max_tokens, max_model_len) is left
  out of step N: the scheduler counts placeholders. One that ends at step N-1 by the token's
  value (a stop token or string, non-finite logits) is already in step N: its row there
  computes one more KV entry and a draw that is discarded. If that row needs a page the pool
  cannot give, the request waits for its token instead of failing (the token may end it).
- A request that ends while a token is in flight (abort, kv_capacity_exceeded) ends without
  that token, as if it had ended a step sooner.
- Penalties need the previous tokens' values on the host: when a step samples a request
  with penalties, the next call reads that step before scheduling (no overlap for it).
- A grammar's mask for step N needs step N-1's token in its matcher: when step N samples a
  constrained request, step N-1 is read after step N's model run is queued and before its
  sampling, so the host reads, advances the matchers and fills the masks while the device runs
  the model (worker.engine.grammar.masks).

The synchronous engine runs the same code and reads each step right after launching it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from worker.engine.request import Request
from worker.engine.sampler import SampledTokens, has_penalties
from worker.engine.speculative.verify import Verification
from worker.engine.transfer import to_host


@dataclass
class LaunchedStep:
    """A step whose draws the host has not read yet."""

    requests: list[Request]  # the requests that sampled, one per row of the draws
    indices: list[int]  # where each one's placeholder sits in its token_ids
    device_tokens: torch.Tensor  # [N] the draws on the device: the next step's future token ids
    draws: SampledTokens  # host copies, complete once `landed` has fired (None: already on the host)
    landed: torch.cuda.Event | None
    constrained: bool  # a request that sampled has a grammar: reading the step advances matchers
    verification: Verification | None = None  # it verified drafts (worker/engine/speculative)
    read: bool = False  # the engine has turned its draws into outputs

    @property
    def needs_host_tokens(self) -> bool:
        """Whether the next step needs these tokens' values on the host: its sampling (penalties),
        or its inputs, which depend on how many drafted tokens were accepted."""
        if self.verification is not None:
            return True
        return any(has_penalties(r.params) and not r.is_finished for r in self.requests)

    def wait(self) -> SampledTokens:
        if self.landed is not None:
            self.landed.synchronize()
        return self.draws


def launched(
    requests: list[Request],
    sampled: SampledTokens,
    constrained: bool,
    verification: Verification | None = None,
) -> LaunchedStep:
    """Starts the draws' copy to the host and gives each row a placeholder for its token in its
    request (a request that ended since its row was scheduled gets none: its draw is discarded)."""
    draws, landed = copy_to_host(sampled)
    indices = []
    for row, req in enumerate(requests):
        indices.append(len(req.token_ids))
        if not req.is_finished:
            req.token_ids.append(placeholder(row))
    return LaunchedStep(requests, indices, sampled.token_ids, draws, landed, constrained, verification)


def placeholder(row: int) -> int:
    return -(row + 1)


def drop_placeholders(req: Request) -> None:
    """Removes the tokens still in flight from a request that ends without them."""
    while req.token_in_flight:
        req.token_ids.pop()


def copy_to_host(sampled: SampledTokens) -> tuple[SampledTokens, torch.cuda.Event | None]:
    """Pinned host copies of the draws, queued behind the sampler on the current stream, and
    the event that marks them complete. Host tensors are returned as they are."""
    if not sampled.token_ids.is_cuda:
        return sampled, None
    copies = {
        f.name: to_host(value) for f in fields(sampled) if isinstance(value := getattr(sampled, f.name), torch.Tensor)
    }
    landed = torch.cuda.Event()
    landed.record()
    return replace(sampled, **copies), landed
