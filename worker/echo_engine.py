"""An engine with no model (`--model echo`): each request's output is its own prompt, one
token per step, over a byte-level tokenizer. It keeps the Engine API's whole contract (slots,
KV page accounting, abort, capacity, stats, resuming after given output tokens), so it measures
and tests the queue path where a model's cost would hide it. Of the sampling parameters it
honours max_tokens only."""
from __future__ import annotations

import codecs
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from producer_client.errors import InvalidArgument
from producer_client.schema import SamplingParams
from worker.engine.outputs import Capacity, EngineStats, RequestOutput, TokenCounts
from worker.engine.settings import EngineSettings
from worker.engine.errors import KVCapacityExceeded, PromptTooLong

DEFAULT_NUM_PAGES = 4096
DEFAULT_MAX_MODEL_LEN = 4096


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; the part of the Tokenizer API the queue loop uses."""

    vocab_size = 256
    eos_token_ids = frozenset()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, tokenize: bool = False,
    ) -> str | list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        if add_generation_prompt:
            text += "assistant: "
        return self.encode(text) if tokenize else text


@dataclass
class EchoRequest:
    request_id: str
    prompt: list[int]
    max_tokens: int
    pages: int
    emitted: int = 0
    decoder: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))

    @property
    def target(self) -> int:
        return min(len(self.prompt), self.max_tokens)

    def usage(self) -> TokenCounts:
        return TokenCounts(len(self.prompt), self.emitted, 0)


class EchoEngine:
    def __init__(self, settings: EngineSettings):
        self.settings = settings
        self.tokenizer = ByteTokenizer()
        self.max_model_len = settings.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.num_pages = settings.num_pages or DEFAULT_NUM_PAGES
        self.waiting: deque[EchoRequest] = deque()
        self.running: dict[str, EchoRequest] = {}
        self._ended: list[RequestOutput] = []
        self._steps = 0

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
        resume_token_ids: Sequence[int] = (),
    ) -> None:
        """As Engine.add_request: `resume_token_ids` are output tokens produced already (by an
        earlier run of the job), counted as output and not emitted again."""
        if request_id in self.running or any(r.request_id == request_id for r in self.waiting):
            raise InvalidArgument("request_id", f"{request_id!r} is already running")
        if not prompt_token_ids or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.tokenizer.vocab_size:
            raise InvalidArgument("prompt_token_ids", f"must be a non-empty list of ids in [0, {self.tokenizer.vocab_size})")
        if list(resume_token_ids) != list(prompt_token_ids[: len(resume_token_ids)]) or len(resume_token_ids) >= min(
            len(prompt_token_ids), params.max_tokens
        ):
            raise InvalidArgument("resume_token_ids", "must be a proper prefix of the echo this request produces")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong("prompt_token_ids", f"{len(prompt_token_ids)} tokens leave no room for output")
        pages = -(-(len(prompt_token_ids) + params.max_tokens) // self.settings.page_size)
        if pages > self.num_pages:
            raise KVCapacityExceeded(f"request {request_id} needs {pages} KV pages, the pool holds {self.num_pages}")
        req = EchoRequest(request_id, list(prompt_token_ids), params.max_tokens, pages, emitted=len(resume_token_ids))
        req.decoder.decode(bytes(resume_token_ids))  # the decoder's state after them, their text dropped
        self.waiting.append(req)

    def step(self) -> list[RequestOutput]:
        self._steps += 1
        outputs, self._ended = self._ended, []
        self._admit()
        for req in list(self.running.values()):
            outputs.append(self._emit_next(req))
        return outputs

    def abort(self, request_id: str) -> bool:
        req = self.running.pop(request_id, None)
        if req is None:
            req = next((r for r in self.waiting if r.request_id == request_id), None)
            if req is None:
                return False
            self.waiting.remove(req)
        self._ended.append(RequestOutput(request_id, [], "", True, "abort", req.usage()))
        return True

    def capacity(self) -> Capacity:
        promised = sum(r.pages for r in self.waiting)
        return Capacity(
            free_slots=max(0, self.settings.max_running - len(self.running) - len(self.waiting)),
            free_pages=max(0, self._free_pages() - promised),
            page_size=self.settings.page_size,
        )

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self._ended)

    def stats(self) -> EngineStats:
        return EngineStats(self._steps, 0, 0, 0, 0, 0)

    def _free_pages(self) -> int:
        return self.num_pages - sum(r.pages for r in self.running.values())

    def _admit(self) -> None:
        while (
            self.waiting and len(self.running) < self.settings.max_running
            and self.waiting[0].pages <= self._free_pages()
        ):
            req = self.waiting.popleft()
            self.running[req.request_id] = req

    def _emit_next(self, req: EchoRequest) -> RequestOutput:
        token = req.prompt[req.emitted]
        req.emitted += 1
        finished = req.emitted >= req.target
        text = req.decoder.decode(bytes([token]), final=finished)
        reason = None
        if finished:
            del self.running[req.request_id]
            reason = "length" if req.emitted >= req.max_tokens else "stop"
        return RequestOutput(req.request_id, [token], text, finished, reason, req.usage())
