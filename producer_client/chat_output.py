"""A chat job's output split into what OpenAI's clients read: the reasoning (Qwen3's `<think>`
block), the answer, and the tool calls (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, the Hermes format Qwen3's chat template asks for).

One incremental state machine over the detokenized text does it, for streams and whole outputs
alike: `parse_output(text)` is `push(text)` then `finish()`, so the deltas of a stream, however
the text was cut into pieces, add up to the whole output's parse. It holds back only what the
next piece could still change: the start of a marker (`</thi`), newlines that may turn out to
end the reasoning, whitespace that may turn out to sit next to a tool call, and a tool call's
body until it closes (its JSON is only known to be valid then).

The rules, each the fix of a bug report against other Qwen3 parsers:
- Reasoning is a `<think>` block at the very start of the output (leading whitespace allowed),
  or, when the prompt itself opened `<think>`, everything up to `</think>`. With thinking off
  there is no reasoning: a literal `<think>` is answer text (vLLM#19839, QwenLM/Qwen3#1297 put the
  answer into reasoning_content there).
- An output cut off inside the reasoning is reasoning (finish_reason says `length`).
- Tool calls are parsed in the answer only, never inside the reasoning (verl#4757: a call drafted
  while thinking was run as a real one).
- A block whose JSON is malformed, that names a function the job did not offer, or that the
  output ends inside (truncated by max_tokens: vLLM PR#35230) is answer text, kept whole.
- Whitespace next to a tool call is dropped, unless it separates answer text before the call from
  answer text after it; all other text around calls is kept. Markers may be split anywhere.
- A `</tool_call>` inside one of a call's JSON strings is the argument's text, not the call's end
  (a tool's parameter may spell it, and the grammar then makes the model write it).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass, field
from typing import NoReturn

from pydantic import BaseModel, ConfigDict

from producer_client.chat import FunctionCall, ToolCall, tool_call_id

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
WHITESPACE = " \t\r\n"


class Reasoning(str, enum.Enum):
    OFF = "off"  # thinking is off: the whole output is the answer
    OPTIONAL = "optional"  # a <think> block at the start of the output is the reasoning
    OPEN = "open"  # the prompt opened <think>: the output starts inside the reasoning


class OutputFormat(BaseModel):
    """How a chat job's output is split: set by the worker from the job and its rendered prompt,
    and sent in the job's `start` event so that any reader of its stream splits it the same way."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reasoning: Reasoning = Reasoning.OFF
    tools: list[str] | None = None  # functions whose calls are parsed; None: no tool call is


@dataclass(frozen=True)
class ParsedCall:
    index: int  # the call's position among the output's calls, from 0
    name: str
    arguments: str  # a JSON object as text

    def of_job(self, job_id: str) -> ToolCall:
        return ToolCall(
            id=tool_call_id(job_id, self.index), function=FunctionCall(name=self.name, arguments=self.arguments)
        )


@dataclass
class OutputDelta:
    """What one piece of text added: reasoning, answer, and the tool calls completed."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ParsedCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


class State(enum.Enum):
    START = "start"  # deciding whether the output opens with <think>
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"  # inside <tool_call>, collecting its body


class OutputParser:
    def __init__(self, fmt: OutputFormat):
        self.parses_calls = fmt.tools is not None
        self.tools = frozenset(fmt.tools or ())
        self.state = {
            Reasoning.OFF: State.CONTENT,
            Reasoning.OPTIONAL: State.START,
            Reasoning.OPEN: State.REASONING,
        }[fmt.reasoning]
        self.text = ""  # received and not yet settled
        self.skip_newlines = self.state is State.REASONING  # the reasoning's (or after it, the answer's) leading ones
        self.space = ""  # whitespace after the answer's last text: kept before text, dropped next to a call
        self.after_call = False  # `space` follows a tool call
        self.call_space = ""  # the whitespace before the open call: its text if the call is no call
        self.scanned = 0  # how much of a call's body is known to hold no CALL_CLOSE
        self.calls = 0
        self.wrote_text = False  # some answer text is out: whitespace after a call may separate more from it

    def push(self, text: str) -> OutputDelta:
        out = OutputDelta()
        self.text += text
        self._advance(out, final=False)
        return out

    def finish(self) -> OutputDelta:
        """The end of the output: whatever was held back is settled."""
        out = OutputDelta()
        self._advance(out, final=True)
        if self.state is State.REASONING:
            out.reasoning += self.text
        elif self.state is State.CALL:
            self._text(out, self.call_space + CALL_OPEN + self.text)
        else:
            self._text(out, self.text)
        if self.space and not self.after_call:
            out.content += self.space
        self.text = self.space = ""
        return out

    def _advance(self, out: OutputDelta, final: bool) -> None:
        step = {
            State.START: self._start,
            State.REASONING: self._reasoning,
            State.CONTENT: self._content,
            State.CALL: self._call,
        }
        while self.text and step[self.state](out, final):
            pass

    # Each step settles what it can of self.text; True when the state changed and the rest is
    # the next state's to read.

    def _start(self, out: OutputDelta, final: bool) -> bool:
        body = self.text.lstrip(WHITESPACE)
        if body.startswith(THINK_OPEN):
            self.text = body[len(THINK_OPEN) :]
            self.state, self.skip_newlines = State.REASONING, True
            return True
        if THINK_OPEN.startswith(body) and not final:
            return False  # still could be
        self.state = State.CONTENT
        return True

    def _reasoning(self, out: OutputDelta, final: bool) -> bool:
        if not self._past_leading_newlines():
            return False
        end = self.text.find(THINK_CLOSE)
        if end >= 0:
            out.reasoning += self.text[:end].rstrip("\n")
            self.text = self.text[end + len(THINK_CLOSE) :]
            self.state, self.skip_newlines = State.CONTENT, True
            return True
        if final:
            return False  # finish() takes it all
        settled = self.text[: len(self.text) - partial_marker(self.text, THINK_CLOSE)].rstrip("\n")
        out.reasoning += settled
        self.text = self.text[len(settled) :]
        return False

    def _content(self, out: OutputDelta, final: bool) -> bool:
        if not self._past_leading_newlines():
            return False
        if not self.parses_calls:
            out.content += self.text
            self.text = ""
            return False
        start = self.text.find(CALL_OPEN)
        if start >= 0:
            before = self.text[:start]
            self._text(out, before.rstrip(WHITESPACE))
            self.call_space = self.space + before[len(before.rstrip(WHITESPACE)) :]
            self.space = ""
            self.text = self.text[start + len(CALL_OPEN) :]
            self.state, self.scanned = State.CALL, 0
            return True
        if final:
            return False  # finish() takes it all
        held = partial_marker(self.text, CALL_OPEN)
        settled = self.text[: len(self.text) - held]
        self._text(out, settled)
        self.text = self.text[len(settled) :]
        return False

    def _call(self, out: OutputDelta, final: bool) -> bool:
        end = self.text.find(CALL_CLOSE, self.scanned)
        while end >= 0 and inside_a_json_string(self.text[:end]):
            end = self.text.find(CALL_CLOSE, end + 1)
        if end < 0:
            self.scanned = max(0, len(self.text) - len(CALL_CLOSE) + 1)
            return False
        body, self.text = self.text[:end], self.text[end + len(CALL_CLOSE) :]
        self.state = State.CONTENT
        call = self._call_of(body)
        if call is None:
            self._text(out, self.call_space + CALL_OPEN + body + CALL_CLOSE)
        else:
            out.tool_calls.append(call)
            self.calls += 1
            self.after_call = True
        self.call_space = ""
        return True

    def _past_leading_newlines(self) -> bool:
        """Drops the newlines that open the reasoning, or the answer after it; False while only those came."""
        if self.skip_newlines:
            self.text = self.text.lstrip("\n")
            if not self.text:
                return False
            self.skip_newlines = False
        return True

    def _text(self, out: OutputDelta, text: str) -> None:
        """Answer text: its trailing whitespace waits in `space` until we know what follows it."""
        body = text.strip(WHITESPACE)
        if not body:
            self.space += text
            return
        before = self.space + text[: text.index(body[0])]
        out.content += ("" if self.after_call and not self.wrote_text else before) + body
        self.space = text[len(text.rstrip(WHITESPACE)) :]
        self.after_call, self.wrote_text = False, True

    def _call_of(self, body: str) -> ParsedCall | None:
        try:
            call = json.loads(body, parse_constant=refuse_constant)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.tools:
            return None
        arguments = call.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments, parse_constant=refuse_constant)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(self.calls, call["name"], json.dumps(arguments, ensure_ascii=False))


# A JSON string, escapes and all: what lies between two of these in a call's body is outside strings.
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


def inside_a_json_string(body: str) -> bool:
    """Whether a call's body, a JSON object so far, ends inside one of its strings: a CALL_CLOSE
    there is an argument's text (a tool's parameter may spell it, and the grammar then makes the
    model write it), not the call's end. A body that opens no object is not JSON: its first
    CALL_CLOSE ends it, as ever."""
    if not body.lstrip(WHITESPACE).startswith("{"):
        return False
    return '"' in JSON_STRING.sub("", body)


@dataclass(frozen=True)
class ChatOutput:
    content: str
    reasoning: str
    tool_calls: list[ParsedCall]


def parse_output(text: str, fmt: OutputFormat) -> ChatOutput:
    """The whole output's split: the same parser as a stream's, fed the text at once."""
    parser = OutputParser(fmt)
    first, last = parser.push(text), parser.finish()
    return ChatOutput(
        first.content + last.content, first.reasoning + last.reasoning, first.tool_calls + last.tool_calls
    )


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (and is shorter than it)."""
    start = text.find(marker[0], max(0, len(text) - len(marker) + 1))
    while start >= 0:
        if marker.startswith(text[start:]):
            return len(text) - start
        start = text.find(marker[0], start + 1)
    return 0


def refuse_constant(name: str) -> NoReturn:
    # json.loads takes NaN and Infinity, which are not JSON: the arguments could not be sent on.
    raise ValueError(f"{name} is not JSON")
