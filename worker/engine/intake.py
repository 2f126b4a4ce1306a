"""A request's way into the engine: its arguments checked, then built as a Request (its
detokenizer and stop strings, its seeded generator, its LoRA adapter's handle, its grammar sent to
the compile thread, the tokens of an earlier run replayed), ready for the scheduler."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import torch

from producer_client.errors import InvalidArgument, UnknownAdapter
from producer_client.schema import SamplingParams
from worker.engine.errors import PromptTooLong
from worker.engine.grammar.compiler import GrammarCompiler
from worker.engine.grammar.constraint import Constraint
from worker.engine.grammar.request_grammar import RequestGrammar, replayed
from worker.engine.lora.adapters import AdapterHandle
from worker.engine.lora.manager import LoraManager
from worker.engine.outputs import RequestId
from worker.engine.reader import StepReader
from worker.engine.request import Request
from worker.engine.stop import TextOutput
from worker.model.tokenizer import Tokenizer


class RequestIntake:
    def __init__(
        self,
        tokenizer: Tokenizer,
        grammars: GrammarCompiler,
        reader: StepReader,
        lora: LoraManager | None,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: list[int],
        device: torch.device,
    ):
        self.tokenizer = tokenizer
        self.grammars = grammars
        self.reader = reader  # its live requests: an id already running is refused
        self.lora = lora  # the adapters it serves (None: none)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.arrivals = itertools.count()  # first come, first served among equal priorities

    def build(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        resume_token_ids: Sequence[int],
        constraint: Constraint | None,
        adapter: str | None,
    ) -> Request:
        """The request, its grammar (if any) compiling; Engine.add_request says what each argument means."""
        self.check(request_id, prompt_token_ids, params)
        handle = self._adapter(adapter) if adapter is not None else None
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        detokenizer = self.tokenizer.incremental_detokenizer(skip_special_tokens=True)
        req = Request(
            request_id,
            prompt_token_ids,
            params,
            priority,
            next(self.arrivals),
            TextOutput(detokenizer, params.stop),
            generator,
        )
        req.adapter = handle
        self.reader.replay(req, list(resume_token_ids))
        if constraint is None and params.response_format is not None:
            constraint = Constraint.of_format(params.response_format)
        if constraint is not None:
            req.grammar = self._compile(constraint, params, resume_token_ids)
        return req

    def _adapter(self, name: str) -> AdapterHandle:
        if self.lora is None:
            raise UnknownAdapter(name, "by this worker (it serves no LoRA adapters)")
        return self.lora.handle(name)

    def _compile(
        self, constraint: Constraint, params: SamplingParams, resume_token_ids: Sequence[int]
    ) -> RequestGrammar:
        compiled = self.grammars.submit(constraint, functools.partial(replayed, constraint, list(resume_token_ids)))
        ends = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        return RequestGrammar(constraint, compiled, ends)

    def check(self, request_id: RequestId, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.reader.live:
            raise InvalidArgument("request_id", f"{request_id!r} is already running")
        if not prompt_token_ids:
            raise InvalidArgument("prompt_token_ids", "must not be empty")
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.vocab_size:
            raise InvalidArgument("prompt_token_ids", f"token ids must be in [0, {self.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong(
                "prompt_token_ids",
                f"{len(prompt_token_ids)} tokens leave no room for output within max_model_len {self.max_model_len}",
            )
        params.check_consistency()
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidArgument("stop_token_ids", f"token ids must be below the vocabulary size {self.vocab_size}")
