"""A request's state as it moves through the engine (what the engine reports is in outputs.py)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from producer_client.schema import SamplingParams
from worker.engine.outputs import FinishReason, RequestError, RequestId, SampledLogprob, TokenCounts

if TYPE_CHECKING:
    import torch

    from worker.engine.grammar.request_grammar import RequestGrammar
    from worker.engine.lora.adapters import AdapterHandle
    from worker.engine.radix_cache import TreeNode
    from worker.engine.stop import TextOutput


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Request:
    """One sequence: its tokens (prompt then output), how many have KV in the cache, and its pages.

    The model always extends `token_ids[num_computed_tokens:]`; when that reaches the end
    of the sequence the step samples a token. After preemption `num_computed_tokens` drops
    to 0 and the whole sequence, outputs included, is recomputed (minus any cached prefix).
    """

    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival: int,
        text: TextOutput,
        generator: torch.Generator | None,
    ):
        self.request_id = request_id
        self.params = params
        self.priority = priority
        self.arrival = arrival
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.pages: list[int] = []
        self.cache_node: TreeNode | None = None
        self.num_cached_prompt_tokens = 0  # found in the prefix cache at first admission
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: RequestError | None = None
        self.text = text
        self.generator = generator
        self.logprobs: list[SampledLogprob] | None = [] if params.logprobs is not None else None
        self.grammar: RequestGrammar | None = None  # structured outputs: what the output must match
        self.adapter: AdapterHandle | None = None  # the LoRA adapter it runs with; None: the base model

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower runs sooner: priority first (lower number = more urgent, as in vLLM), then arrival."""
        return (self.priority, self.arrival)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def ends_by_length(self, num_output: int, max_model_len: int) -> bool:
        """Whether its `num_output`-th output token is its last by length: max_tokens, or max_model_len."""
        return num_output >= self.params.max_tokens or self.num_prompt_tokens + num_output >= max_model_len

    @property
    def token_in_flight(self) -> bool:
        """Whether its last token is a placeholder for a draw the host has not read (overlap.py)."""
        return bool(self.token_ids) and self.token_ids[-1] < 0

    @property
    def ready(self) -> bool:
        """Whether it can be admitted: its grammar, if it has one, is compiled and started, and its
        adapter, if it has one, is in a device slot."""
        grammar_ready = self.grammar is None or self.grammar.started
        return grammar_ready and (self.adapter is None or self.adapter.slot is not None)

    @property
    def adapter_name(self) -> str | None:
        """Whose prefix cache its KV belongs to: its adapter's, or the base model's (None)."""
        return self.adapter.name if self.adapter is not None else None

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def usage(self) -> TokenCounts:
        return TokenCounts(self.num_prompt_tokens, self.num_output_tokens, self.num_cached_prompt_tokens)

    def finish(self, reason: FinishReason, error: RequestError | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
