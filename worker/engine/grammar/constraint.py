"""What a request's output must match, as the engine takes it: an llguidance grammar, and the
token after which it applies.

A response format (producer_client.structured) becomes one with `Constraint.of_format`. Qwen3's
tool calls become one with `tool_call_constraint`: the output is one or more
`<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` blocks, each naming one of the
given functions with arguments valid against its parameters' schema. That is the hook for a
chat's `tool_choice` "required" (any of its tools) or a named function (that one only).

With Qwen3's thinking on, the model writes `<think>...</think>` before its answer: the grammar
starts after `starts_after` (the id of `</think>`), and until then the output is free, except
that it may not end. Qwen3 puts a blank line between `</think>` and its answer, so such a grammar
lets up to four whitespace characters come first.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from producer_client.structured import JSON_OPTIONS, grammar_text, llguidance



@dataclass(frozen=True)
class Constraint:
    grammar: str  # llguidance's grammar, serialized (LLMatcher.grammar_from_*)
    starts_after: int | None = None  # a token id; None: from the first output token
    field: str = "response_format"  # what a compile error names: the request's field it came from

    @classmethod
    def of_format(cls, fmt, starts_after: int | None = None) -> Constraint:
        return cls(after_thinking(grammar_text(fmt), starts_after), starts_after)

    @property
    def key(self) -> str:
        """What compiled grammars are cached by: the same grammar compiles to the same matcher."""
        return hashlib.sha256(self.grammar.encode()).hexdigest()


@dataclass(frozen=True)
class ToolFunction:
    name: str
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; None: any object


def tool_call_constraint(
    functions: Sequence[ToolFunction], parallel: bool = True, starts_after: int | None = None,
) -> Constraint:
    """Output that is Qwen3 tool calls and nothing else: one call, or with `parallel` one or
    more separated by newlines (as Qwen3's chat template writes them), each of one of `functions`."""
    calls = [call_schema(f) for f in functions]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    lark = "\n".join((
        'start: call ("\\n" call)*' if parallel else "start: call",
        # Qwen3's markers are tokens of their own: a Lark string of their text would be the same
        # text in other tokens, which llguidance's matcher refuses where its mask allowed it.
        'call: <tool_call> "\\n" body "\\n" </tool_call>',
        f"body: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}",
    ))
    grammar = after_thinking(llguidance().LLMatcher.grammar_from_lark(lark), starts_after)
    return Constraint(grammar, starts_after, field="tools")


def call_schema(function: ToolFunction) -> dict[str, Any]:
    # The name comes first, as Qwen3 writes it; llguidance keeps the properties' order.
    return {
        "type": "object",
        "properties": {"name": {"const": function.name}, "arguments": function.parameters or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def after_thinking(grammar: str, starts_after: int | None) -> str:
    """The grammar as it is, or, for an answer after the thinking, behind up to four whitespace
    characters (llguidance composes grammars: the first names the next by `@answer`)."""
    if starts_after is None:
        return grammar
    try:
        parts = json.loads(grammar)["grammars"]  # llguidance's JSON form
    except ValueError:
        parts = [{"lark_grammar": grammar}]  # a Lark text
    answer = {**parts[0], "name": "answer"}
    return json.dumps({"grammars": [{"lark_grammar": "start: /[ \\t\\r\\n]{0,4}/ @answer"}, answer, *parts[1:]]})
