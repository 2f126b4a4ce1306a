"""An engine with no model (`--model echo`): each request's output is its own prompt, one
token per step, over a byte-level tokenizer. It keeps the Engine API's whole contract (slots,
KV page accounting, abort, capacity, stats, resuming after given output tokens), so it measures
and tests the queue path where a model's cost would hide it. Of the sampling parameters it
honours max_tokens only.

For tests only, a token script (the JSON file named by MILI_ECHO_SCRIPT) makes it say given
text instead: what a model with random weights never would, such as a tool call or a think block,
to drive an agent loop end to end through the real worker, gateway and SDK.

It serves the LoRA adapters its settings name (lora_modules) by name alone, reading no file: a job
naming one echoes as any other, one naming another fails with UnknownAdapter, as on a model."""

from __future__ import annotations

import codecs
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from producer_client.errors import InvalidArgument, UnknownAdapter
from producer_client.schema import SamplingParams
from worker.engine.errors import KVCapacityExceeded, PromptTooLong
from worker.engine.outputs import (
    Capacity,
    EngineStats,
    FinishReason,
    RequestId,
    RequestOutput,
    TokenCounts,
    token_output,
)
from worker.engine.request import DEFAULT_LANE
from worker.engine.settings import EngineSettings

if TYPE_CHECKING:
    from worker.engine.grammar.constraint import Constraint

DEFAULT_NUM_PAGES = 4096
DEFAULT_MAX_MODEL_LEN = 4096
SCRIPT_VARIABLE = "MILI_ECHO_SCRIPT"


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255; the part of the Tokenizer API the queue loop uses."""

    vocab_size = 256
    eos_token_ids: frozenset[int] = frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode(errors="replace")

    def token_to_id(self, token: str) -> int | None:
        return None  # bytes only: no marker tokens

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tokenize: bool = False,
    ) -> str | list[int]:
        """`role: content` lines (an assistant's tool calls as JSON after its content), the tools'
        names first, and Qwen3's empty think block when thinking is off: what a script can key on."""
        text = f"tools: {', '.join(t['function']['name'] for t in tools)}\n" if tools else ""
        for m in messages:
            calls = f" {json.dumps(m['tool_calls'])}" if m.get("tool_calls") else ""
            text += f"{m['role']}: {m.get('content', '')}{calls}\n"
        if add_generation_prompt:
            text += "assistant: " + ("" if enable_thinking else "<think>\n\n</think>\n\n")
        return self.encode(text) if tokenize else text


@dataclass(frozen=True)
class ScriptLine:
    when: str  # said for a prompt that holds this text ("" : any prompt)
    say: str


@dataclass(frozen=True)
class EchoScript:
    """What the echo engine says instead of the prompt: the first line whose `when` the prompt
    holds (none: the echo)."""

    lines: tuple[ScriptLine, ...]

    @classmethod
    def from_environment(cls) -> EchoScript | None:
        path = os.environ.get(SCRIPT_VARIABLE)
        if not path:
            return None
        with open(path, encoding="utf-8") as f:
            return cls(tuple(ScriptLine(**line) for line in json.load(f)))

    def output_for(self, prompt: list[int]) -> list[int] | None:
        text = bytes(prompt).decode(errors="replace")
        line = next((line for line in self.lines if line.when in text), None)
        return None if line is None else list(line.say.encode())


@dataclass
class EchoRequest:
    request_id: RequestId
    prompt: list[int]
    output: list[int]  # what it says: the prompt, or its script's line
    max_tokens: int
    pages: int
    emitted: int = 0
    lane: int = DEFAULT_LANE
    decoder: codecs.IncrementalDecoder = field(
        default_factory=partial(codecs.getincrementaldecoder("utf-8"), "replace")
    )
    target: int = field(init=False)  # tokens it emits in all
    prompt_len: int = field(init=False)  # its usage's prompt tokens, counted once (a model's Request keeps it too)
    # An ASCII output's text: each token's text is its character, what the decoder would give
    # token by token; read by index, so that the stand-in for a model spends no decoding per token
    # (None: the output has multi-byte characters, decoded as they come).
    ascii_text: str | None = field(init=False)

    def __post_init__(self) -> None:
        self.target = min(len(self.output), self.max_tokens)
        self.prompt_len = len(self.prompt)
        said = bytes(self.output[: self.target])
        self.ascii_text = said.decode("ascii") if said.isascii() else None

    def usage(self) -> TokenCounts:
        return TokenCounts(self.prompt_len, self.emitted, 0)


class EchoEngine:
    def __init__(self, settings: EngineSettings, script: EchoScript | None = None):
        self.settings = settings
        self.script = script
        self.tokenizer = ByteTokenizer()
        self.max_model_len = settings.max_model_len or DEFAULT_MAX_MODEL_LEN
        self.num_pages = settings.num_pages or DEFAULT_NUM_PAGES
        # Both by request id, so that admitting, aborting and finding a duplicate cost the same
        # whether few requests are held or max_running (a bulk load holds that many); the waiting
        # ones in arrival order within each lane (`lanes`), the higher lanes' first.
        self.waiting: dict[RequestId, EchoRequest] = {}
        self.lanes: tuple[dict[RequestId, EchoRequest], ...] = ({}, {}, {})
        self.running: dict[RequestId, EchoRequest] = {}
        self.preemptions = 0
        # The echo engine's KV pool is this count: pages held by running requests, and promised
        # to waiting ones.
        self.running_pages = 0
        self.waiting_pages = 0
        self._ended: list[RequestOutput] = []
        self._steps = 0

    def add_request(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        resume_token_ids: Sequence[int] = (),
        constraint: Constraint | None = None,
        adapter: str | None = None,
        lane: int = DEFAULT_LANE,
    ) -> None:
        """As Engine.add_request: `resume_token_ids` are output tokens produced already (by an
        earlier run of the job), counted as output and not emitted again; a request that cannot
        start for want of a slot or pages preempts a running one of a lower `lane`. An echo cannot
        follow a grammar: a request with a response format or a forced tool call is refused.
        `priority` is not honoured (the queue's tests need lanes only)."""
        if request_id in self.running or request_id in self.waiting:
            raise InvalidArgument("request_id", f"{request_id!r} is already running")
        if adapter is not None and adapter not in self.settings.lora_modules:
            raise UnknownAdapter(adapter, "by this worker")
        if constraint is not None or params.response_format is not None:
            field = "response_format" if params.response_format is not None else "tool_choice"
            raise InvalidArgument(field, "the echo engine cannot hold its output to a grammar")
        if not prompt_token_ids or min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.tokenizer.vocab_size:
            raise InvalidArgument(
                "prompt_token_ids", f"must be a non-empty list of ids in [0, {self.tokenizer.vocab_size})"
            )
        output = (self.script and self.script.output_for(prompt_token_ids)) or list(prompt_token_ids)
        if list(resume_token_ids) != output[: len(resume_token_ids)] or len(resume_token_ids) >= min(
            len(output), params.max_tokens
        ):
            raise InvalidArgument("resume_token_ids", "must be a proper prefix of the echo this request produces")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong("prompt_token_ids", f"{len(prompt_token_ids)} tokens leave no room for output")
        pages = -(-(len(prompt_token_ids) + params.max_tokens) // self.settings.page_size)
        if pages > self.num_pages:
            raise KVCapacityExceeded(f"request {request_id} needs {pages} KV pages, the pool holds {self.num_pages}")
        req = EchoRequest(
            request_id, list(prompt_token_ids), output, params.max_tokens, pages, len(resume_token_ids), lane
        )
        if resume_token_ids:
            req.decoder.decode(bytes(resume_token_ids))  # the decoder's state after them, their text dropped
        self._wait(req)

    def step(self) -> list[RequestOutput]:
        self._steps += 1
        outputs, self._ended = self._ended, []
        self._admit()
        outputs += [self._emit_next(req) for req in list(self.running.values())]
        return outputs

    def abort(self, request_id: RequestId) -> bool:
        if request_id in self.running:
            req = self._release(request_id)
        elif request_id in self.waiting:
            req = self._unwait(request_id)
        else:
            return False
        self._ended.append(RequestOutput(request_id, [], "", True, "abort", req.usage()))
        return True

    def capacity(self) -> Capacity:
        return Capacity(
            free_slots=max(0, self.settings.max_running - len(self.running) - len(self.waiting)),
            free_pages=max(0, self._free_pages() - self.waiting_pages),
            page_size=self.settings.page_size,
        )

    def has_unfinished(self) -> bool:
        return bool(self.running or self.waiting or self._ended)

    def stats(self) -> EngineStats:
        return EngineStats(self._steps, 0, 0, self.preemptions, 0, 0)

    def adapters(self) -> tuple[list[str], list[str]] | None:
        names = sorted(self.settings.lora_modules)
        return (names, names) if names else None

    def _free_pages(self) -> int:
        return self.num_pages - self.running_pages

    def _wait(self, req: EchoRequest, first: bool = False) -> None:
        lane = self.lanes[req.lane]
        if first:  # a preempted request goes back before those that came after it
            items = list(lane.items())
            lane.clear()
            lane[req.request_id] = req
            lane.update(items)
        else:
            lane[req.request_id] = req
        self.waiting[req.request_id] = req
        self.waiting_pages += req.pages

    def _unwait(self, request_id: RequestId) -> EchoRequest:
        req = self.waiting.pop(request_id)
        del self.lanes[req.lane][request_id]
        self.waiting_pages -= req.pages
        return req

    def _admit(self) -> None:
        while self.waiting:
            req = next(iter(next(lane for lane in self.lanes if lane).values()))
            while len(self.running) >= self.settings.max_running or req.pages > self._free_pages():
                if not self._preempt_lower(req):
                    return
            self._unwait(req.request_id)
            self.running[req.request_id] = req
            self.running_pages += req.pages

    def _preempt_lower(self, req: EchoRequest) -> bool:
        """Preempt the running request of the lowest lane below `req`'s that came last; whether
        there was one. Its output so far stays (an echo recomputes nothing)."""
        lower = [r for r in self.running.values() if r.lane > req.lane]
        if not lower:
            return False
        victim = max(reversed(lower), key=lambda r: r.lane)
        self._release(victim.request_id)
        self._wait(victim, first=True)
        self.preemptions += 1
        return True

    def _release(self, request_id: RequestId) -> EchoRequest:
        req = self.running.pop(request_id)
        self.running_pages -= req.pages
        return req

    def _emit_next(self, req: EchoRequest) -> RequestOutput:
        at = req.emitted
        token = req.output[at]
        req.emitted = emitted = at + 1
        if emitted < req.target:
            text = req.ascii_text[at] if req.ascii_text is not None else req.decoder.decode(bytes([token]))
            # As the model engine's StepReader builds it: the stand-in pays what the model's engine does.
            return token_output(req.request_id, token, text, req.prompt_len, emitted, 0, None)
        text = req.ascii_text[at] if req.ascii_text is not None else req.decoder.decode(bytes([token]), final=True)
        self._release(req.request_id)
        reason: FinishReason = "length" if emitted >= req.max_tokens else "stop"
        return RequestOutput(req.request_id, [token], text, True, reason, req.usage())
