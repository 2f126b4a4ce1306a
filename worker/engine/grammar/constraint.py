"""What a request's output must match, as the engine takes it: an llguidance grammar, and how a
reasoning block before it is told apart.

A response format (producer_client.structured) becomes one with `Constraint.of_format`. Qwen3's
tool calls become one with `tool_call_constraint`: the output is one or more
`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` blocks (the markers as Qwen3's tokens),
each naming one of the given functions with arguments valid against its parameters' schema, or,
when an answer format is given too, either such calls or that answer. That is the hook for a
chat's `tool_choice`: "required" (any of its tools), a named function (that one only), "auto"
with a response format (a call or a structured answer).

With Qwen3's thinking on, the model writes `<think>...</think>` before its answer (`Thinking`):
the output is free until `</think>`, except that it may not end, and the grammar holds from the
next token. Where the prompt has not opened the block, the first token decides: `<think>` opens
it, any other token is the answer's first. Qwen3 puts a blank line between `</think>` and its
answer, so a grammar after thinking lets up to four whitespace characters come first.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from producer_client.structured import JSON_OPTIONS, grammar_text

LEADING_WHITESPACE = "/[ \\t\\r\\n]{0,4}/"


class Phase(enum.Enum):
    DECIDING = "deciding"  # the first token: the thinking's opening, or the answer's start
    THINKING = "thinking"  # free until the thinking closes
    ANSWERING = "answering"  # the grammar holds


@dataclass(frozen=True)
class Thinking:
    """The token ids of a reasoning block's markers. `opens`: the output may open the block with
    it (None: the prompt opened it already, and the output starts inside it)."""

    closes: int
    opens: int | None = None

    @property
    def first_phase(self) -> Phase:
        return Phase.DECIDING if self.opens is not None else Phase.THINKING

    def after(self, phase: Phase, token: int) -> tuple[Phase, bool]:
        """The phase after `token`, and whether the grammar takes `token` as the answer's."""
        if phase is Phase.THINKING:
            return (Phase.ANSWERING if token == self.closes else Phase.THINKING), False
        if phase is Phase.DECIDING and token == self.opens:
            return Phase.THINKING, False
        return Phase.ANSWERING, True


@dataclass(frozen=True)
class Constraint:
    grammar: str  # llguidance's grammar, serialized (LLMatcher.grammar_from_*, or composed here)
    thinking: Thinking | None = None  # None: the grammar holds from the first output token
    field: str = "response_format"  # what a compile error names: the request's field it came from

    @classmethod
    def of_format(cls, fmt, thinking: Thinking | None = None) -> Constraint:
        grammar = grammar_text(fmt)
        if thinking is not None:
            grammar = composed(None, grammar, thinking)
        return cls(grammar, thinking)

    @property
    def key(self) -> str:
        """What compiled grammars are cached by: the same grammar compiles to the same matcher."""
        return hashlib.sha256(self.grammar.encode()).hexdigest()

    @property
    def first_phase(self) -> Phase:
        return Phase.ANSWERING if self.thinking is None else self.thinking.first_phase

    def after(self, phase: Phase, token: int) -> tuple[Phase, bool]:
        if self.thinking is None:
            return Phase.ANSWERING, True
        return self.thinking.after(phase, token)


@dataclass(frozen=True)
class ToolFunction:
    name: str
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: any object


def tool_call_constraint(
    functions: Sequence[ToolFunction],
    parallel: bool = True,
    answer_format=None,
    thinking: Thinking | None = None,
) -> Constraint:
    """Output that is Qwen3 tool calls (one, or with `parallel` one or more separated by newlines
    as Qwen3's chat template writes them, each of one of `functions`), or, with `answer_format`,
    either that or an answer in the format."""
    calls = [call_schema(f) for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    rules = (
        'calls: call ("\\n" call)*' if parallel else "calls: call",
        # Qwen3's markers are tokens of their own: a Lark string of their text would be the same
        # text in other tokens, which llguidance's matcher refuses where its mask allowed it.
        'call: <tool_call> "\\n" body "\\n" </tool_call>',
        f"body: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}",
    )
    answer = grammar_text(answer_format) if answer_format is not None else None
    return Constraint(composed(rules, answer, thinking), thinking, field="tools")


def call_schema(function: ToolFunction) -> dict[str, Any]:
    # The name comes first, as Qwen3 writes it; llguidance keeps the properties' order.
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def composed(call_rules: Sequence[str] | None, answer: str | None, thinking: Thinking | None) -> str:
    """One grammar whose start is the calls (rules naming `calls`), the answer (an llguidance
    grammar, referred to as `@answer`), or either; after thinking, behind some whitespace."""
    alternatives = (["calls"] if call_rules else []) + (["@answer"] if answer is not None else [])
    body = alternatives[0] if len(alternatives) == 1 else "(" + " | ".join(alternatives) + ")"
    start = f"start: {LEADING_WHITESPACE} {body}" if thinking is not None else f"start: {body}"
    grammars: list[dict[str, Any]] = [{"lark_grammar": "\n".join([start, *(call_rules or ())])}]
    if answer is not None:
        parts = grammar_parts(answer)
        grammars += [{**parts[0], "name": "answer"}, *parts[1:]]
    return json.dumps({"grammars": grammars})


def grammar_parts(grammar: str) -> list[dict[str, Any]]:
    """An llguidance grammar as the list of its grammars: its JSON form, or one Lark text."""
    try:
        return json.loads(grammar)["grammars"]
    except ValueError:
        return [{"lark_grammar": grammar}]
