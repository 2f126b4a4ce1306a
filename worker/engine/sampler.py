"""Batched sampling with per-request parameters, in vLLM's order:
penalties and min_tokens masking on the raw logits, then greedy rows take the argmax and
the others go through temperature -> min_p -> top_k -> top_p -> a draw
(worker.engine.random_sampling).

What a batch's parameters ask for (which rows are random, want logprobs, carry penalties or
a min_tokens) is derived once per batch: a decoding batch keeps its requests from step to
step, so the plan usually carries over and a step costs no per-request Python here. Penalties
keep each request's token counts on the device, bumped by each draw (PenaltyState).

Each row's logits are also checked for a NaN or an infinity (a numerical fault in the model);
the flag travels with the draws, so checking costs no host sync of its own.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.cpu_argmax import argmax_rows_cpu
from kernels.cpu_argmax import supports as cpu_argmax_supports
from producer_client.schema import SamplingParams
from worker.engine.outputs import SampledLogprob
from worker.engine.random_sampling import DrawParams, sample_random
from worker.engine.request import Request
from worker.engine.transfer import tensor_on, to_device

GREEDY_BELOW = 1e-5  # temperatures under this are greedy, as in vLLM (dividing by them overflows)


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[SampledLogprob | None]
    finite: list[bool]  # per row: whether its logits were all finite; a row that was not drew garbage


@dataclass
class SampledTokens:
    """One step's draws as tensors: what `Sampler.sample` leaves on the device for `Sampler.read`.

    Kept apart from the host lists so an overlapped engine can copy them out asynchronously
    and read them a step later (worker.engine.overlap)."""

    token_ids: torch.Tensor  # [N] int64
    finite: torch.Tensor  # [N] bool: the row's raw logits hold no NaN or infinity
    logprob_rows: list[int]  # the rows whose request asked for logprobs, R of them
    chosen_logprobs: torch.Tensor | None = None  # [R] the sampled token's raw logprob
    top_logprobs: torch.Tensor | None = None  # [R, k] the k most likely, k the largest n asked for
    top_ids: torch.Tensor | None = None  # [R, k]


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0


@dataclass
class BatchPlan:
    """What sampling one batch of requests needs from their parameters."""

    requests: list[Request]
    logprob_rows: list[int]  # rows whose request asked for logprobs
    min_tokens_rows: list[int]  # rows whose request has a min_tokens (stop ids masked until it is reached)
    penalized_rows: list[int]  # rows whose request has a repetition, presence or frequency penalty
    random_index: torch.Tensor | None  # [R] the rows that draw (the others take the argmax), on the device
    draw: DrawParams | None  # theirs

    @classmethod
    def of(cls, requests: list[Request], device: torch.device) -> BatchPlan:
        params = [r.params for r in requests]
        random_rows = [i for i, p in enumerate(params) if not is_greedy(p)]
        return cls(
            list(requests),
            [i for i, p in enumerate(params) if p.logprobs is not None],
            [i for i, p in enumerate(params) if p.min_tokens > 0],
            [i for i, p in enumerate(params) if has_penalties(p)],
            tensor_on(random_rows, device, torch.long) if random_rows else None,
            DrawParams.of([requests[i] for i in random_rows], device) if random_rows else None,
        )


class Sampler:
    def __init__(self, eos_token_ids: list[int]):
        self.eos_token_ids = eos_token_ids
        self.penalties = PenaltyState()
        self._plan: BatchPlan | None = None  # the last batch's

    def __call__(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        mask: Callable[[torch.Tensor], None] | None = None,
    ) -> SampleResult:
        """logits [N, V] float32, one row per request, in the same order; modified in place."""
        return self.read(self.sample(logits, requests, mask), requests)

    @torch.inference_mode()
    def sample(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        mask: Callable[[torch.Tensor], None] | None = None,
    ) -> SampledTokens:
        """The draws, left on the logits' device: no host sync (host lists reach the device
        through worker.engine.transfer, indexes included). `mask`, when given, sets the logits
        of the tokens each row may not draw to -inf (structured outputs), before anything else
        reads them: the logprobs are those of the masked distribution, as vLLM reports them."""
        device = logits.device
        plan = self._plan_for(requests, device)
        finite = None
        if mask is not None:
            finite = rows_finite(logits)  # before the mask writes its -inf
            mask(logits)
        logprob_rows = plan.logprob_rows
        if logprob_rows:
            logprob_index = tensor_on(logprob_rows, device, torch.long)
            raw_logprobs = torch.log_softmax(logits[logprob_index], dim=-1)
        penalized = plan.penalized_rows
        if penalized or plan.min_tokens_rows:
            if finite is None:
                finite = rows_finite(logits)  # before masking writes its own -inf
            if penalized:
                counts = self.penalties.apply(logits, penalized, [requests[i] for i in penalized])
            if plan.min_tokens_rows:
                self._suppress_stops_before_min_tokens(logits, requests, plan.min_tokens_rows)
        if finite is None:
            tokens, finite = greedy_tokens_and_finite(logits)
        else:
            tokens = greedy_tokens(logits)
        if plan.draw is not None and len(plan.draw.requests) == len(requests):
            tokens = sample_random(logits, plan.draw)  # every row draws: no gather of their logits
        elif plan.draw is not None:
            tokens[plan.random_index] = sample_random(logits[plan.random_index], plan.draw)
        if penalized:
            self.penalties.count_drawn(counts, penalized, tokens)
        sampled = SampledTokens(tokens, finite, logprob_rows)
        if logprob_rows:
            k = max(requests[i].params.logprobs for i in logprob_rows)
            sampled.chosen_logprobs = raw_logprobs.gather(1, tokens[logprob_index, None]).squeeze(1)
            sampled.top_logprobs, sampled.top_ids = raw_logprobs.topk(k, dim=-1)
        return sampled

    def read(self, sampled: SampledTokens, requests: list[Request]) -> SampleResult:
        """The draws as host lists (a sync when they are still on the device)."""
        token_ids = sampled.token_ids.tolist()
        logprobs: list[SampledLogprob | None] = [None] * len(requests)
        if sampled.logprob_rows:
            chosen = sampled.chosen_logprobs.tolist()
            top_lp, top_ids = sampled.top_logprobs.tolist(), sampled.top_ids.tolist()
            for j, row in enumerate(sampled.logprob_rows):
                n = requests[row].params.logprobs
                top = tuple(zip(top_ids[j][:n], top_lp[j][:n]))
                logprobs[row] = SampledLogprob(token_ids[row], chosen[j], top)
        return SampleResult(token_ids, logprobs, sampled.finite.tolist())

    def _plan_for(self, requests: list[Request], device: torch.device) -> BatchPlan:
        if self._plan is None or self._plan.requests != requests:
            self._plan = BatchPlan.of(requests, device)
        return self._plan

    def _suppress_stops_before_min_tokens(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        for i in rows:
            r = requests[i]
            if r.num_output_tokens < r.params.min_tokens:
                ids = list(r.params.stop_token_ids)
                if not r.params.ignore_eos:
                    ids += self.eos_token_ids
                logits[i, tensor_on(ids, logits.device, torch.long)] = float("-inf")


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[N] int64: each row's argmax (the first, on ties)."""
    if cpu_argmax_supports(logits):
        return argmax_rows_cpu(logits)
    return logits.argmax(dim=-1)


def greedy_tokens_and_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """greedy_tokens and rows_finite, in one pass over the logits on CPU."""
    if cpu_argmax_supports(logits):
        finite = torch.empty(logits.shape[0], dtype=torch.bool)
        return argmax_rows_cpu(logits, finite), finite
    return logits.argmax(dim=-1), rows_finite(logits)


def rows_finite(logits: torch.Tensor) -> torch.Tensor:
    """[N] bool: whether each row holds no NaN or infinity.

    A row's max and min are non-finite exactly when the row has a NaN (both propagate it)
    or an infinity; two reductions read the logits without writing any temporary, where
    `isfinite(logits).all(-1)` made three [N, vocab] ones, several times slower on CPU."""
    return torch.isfinite(logits.amax(dim=-1)) & torch.isfinite(logits.amin(dim=-1))


@dataclass
class TokenCounts:
    """A penalized request's token statistics on the device, kept from step to step instead of
    rebuilt from its token lists (a Python-level pass over its whole context, every step)."""

    in_prompt: torch.Tensor  # [V] bool
    in_output: torch.Tensor  # [V] float32: occurrences so far

    @classmethod
    def of(cls, req: Request, vocab: int, device: torch.device) -> TokenCounts:
        """From the request's tokens so far (a resumed request's earlier output included)."""
        in_prompt = token_counts([req.prompt_token_ids], vocab, device)[0] > 0
        return cls(in_prompt, token_counts([req.output_token_ids], vocab, device)[0])


class PenaltyState:
    """Each penalized request's TokenCounts, for as long as the request exists."""

    def __init__(self):
        self._counts: weakref.WeakKeyDictionary[Request, TokenCounts] = weakref.WeakKeyDictionary()

    def apply(self, logits: torch.Tensor, rows: list[int], requests: list[Request]) -> list[TokenCounts]:
        """Penalizes `rows` of `logits`, whose requests are `requests`; returns their counts, for
        `count_drawn` once the step's tokens are drawn."""
        vocab, device = logits.shape[1], logits.device
        counts = [self._counts_of(req, vocab, device) for req in requests]
        in_output = torch.stack([c.in_output for c in counts])
        seen = torch.stack([c.in_prompt for c in counts]) | (in_output > 0)
        penalize(logits, rows, requests, in_output, seen)
        return counts

    def count_drawn(self, counts: list[TokenCounts], rows: list[int], tokens: torch.Tensor) -> None:
        """Adds each row's drawn token to its request's output counts, on the device: the draw
        is the request's next output token unless the request ends, and then nothing reads them."""
        one = torch.ones(1, device=tokens.device)
        for c, row in zip(counts, rows):
            c.in_output.index_add_(0, tokens[row : row + 1], one)

    def forget(self, req: Request) -> None:
        """Drops the request's counts: they are rebuilt from its tokens when it next samples."""
        self._counts.pop(req, None)

    def _counts_of(self, req: Request, vocab: int, device: torch.device) -> TokenCounts:
        counts = self._counts.get(req)
        if counts is None:
            counts = self._counts[req] = TokenCounts.of(req, vocab, device)
        return counts


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Penalizes the rows of the requests that have penalties from their token lists alone,
    with no counts carried over from earlier steps."""
    rows = [i for i, r in enumerate(requests) if has_penalties(r.params)]
    if rows:
        PenaltyState().apply(logits, rows, [requests[i] for i in rows])


def penalize(
    logits: torch.Tensor,
    rows: list[int],
    requests: list[Request],
    in_output: torch.Tensor,
    seen: torch.Tensor,
) -> None:
    """`rows` of `logits`, one per request: `in_output` [R, V] output token counts, `seen` [R, V]
    whether each token occurs in the request's prompt or output."""
    device = logits.device
    row_index = tensor_on(rows, device, torch.long)
    sub = logits[row_index]
    rep = tensor_on([r.params.repetition_penalty for r in requests], device)[:, None]
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = tensor_on([r.params.frequency_penalty for r in requests], device)[:, None]
    pres = tensor_on([r.params.presence_penalty for r in requests], device)[:, None]
    sub -= freq * in_output + pres * (in_output > 0)
    logits[row_index] = sub


def token_counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each token id occurs in each list."""
    counts = torch.zeros(len(token_lists), vocab, device=device)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), torch.tensor([len(t) for t in token_lists]))
    ids = torch.tensor([t for tokens in token_lists for t in tokens], dtype=torch.long)
    ones = torch.ones(len(ids), device=device)
    counts.index_put_((to_device(rows, device), to_device(ids, device)), ones, accumulate=True)
    return counts


def skip_draws(req: Request, num_tokens: int, vocab_size: int) -> None:
    """Advances a seeded request's generator past the draws of `num_tokens` tokens it sampled
    in an earlier run, so a resumed request draws what the uninterrupted one would have.
    Mirrors `random_sampling.draw_seeded_noise`: one row of `vocab_size` exponentials per sampled token."""
    if req.generator is None or is_greedy(req.params):
        return
    row = torch.empty(vocab_size, device=req.generator.device)
    for _ in range(num_tokens):
        row.exponential_(generator=req.generator)
