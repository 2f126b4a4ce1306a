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
the output is free until `</think>`, except that it may not end, and the grammar holds from that
token on. Where the prompt has not opened the block, the first token decides: `<think>` opens it,
any other token is the reply's first. Qwen3 puts a blank line between `</think>` and its reply, so
the grammar starts with `</think>` and up to four newlines before the reply, or (where the output
may open the block) with the reply itself: a reply without a think block is exactly the format,
and one after it is the format's answers that do not open with a newline, as the reader gives them
once it has dropped the newlines that follow the reasoning (producer_client.chat_output; a format
every answer of which opens with one keeps the block closed: intake.thinking_before). That reader takes an output that opens with `<think>` (after
whitespace) for a think block, so a reply without one may not open so, in Qwen3's token or in
ordinary ones: it would land in the reasoning. After a think block it may.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import llguidance

from producer_client.chat_output import THINK_OPEN, WHITESPACE
from producer_client.structured import (
    JSON_OPTIONS,
    ByteVocabulary,
    ChoiceFormat,
    RegexFormat,
    byte_tokenizer,
    grammar_text,
)

AFTER_THINKING = "/\\n{0,4}/"
THINK_OPENING = f"/[ \\t\\r\\n]*{THINK_OPEN}(?s:.*)/"  # what the reader takes for a think block


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
        """The phase after `token`, and whether the grammar takes `token` (`</think>` is its first)."""
        if phase is Phase.THINKING:
            return (Phase.ANSWERING, True) if token == self.closes else (Phase.THINKING, False)
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
        return cls(grammar_text(fmt) if thinking is None else composed((), fmt, thinking), thinking)

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
    rules = [
        'calls: call ("\\n" call)*' if parallel else "calls: call",
        # Qwen3's markers are tokens of their own: a Lark string of their text would be the same
        # text in other tokens, which llguidance's matcher refuses where its mask allowed it.
        'call: <tool_call> "\\n" call_body "\\n" </tool_call>',
        "call_body: " + " | ".join(f"call_{i}" for i in range(len(functions))),
    ]
    for i, function in enumerate(functions):
        rules += function_rules(f"call_{i}", function)
    return Constraint(composed(rules, answer_format, thinking), thinking, field="tools")


def function_rules(name: str, function: ToolFunction) -> list[str]:
    """The rule `name`: a call of `function` as Qwen3 writes it, its name first, then arguments
    valid against its parameters. They are a JSON document of their own, as they are in the
    client's check (structured.schema_format): their `$ref`s resolve from their own root, where
    `openai.pydantic_function_tool` puts a nested model's `$defs`."""
    head = json.dumps(f'{{"name": {json.dumps(function.name)}, "arguments": ')
    schema = function.parameters or {"type": "object"}
    return [
        f'{name}: {head} {name}_arguments "}}"',
        f"{name}_arguments: %json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}",
    ]


def composed(call_rules: Sequence[str], fmt, thinking: Thinking | None) -> str:
    """One grammar whose reply is the calls (`call_rules`, naming `calls`), an answer in `fmt` (an
    llguidance grammar of its own), or either; after thinking, as the module's docstring says."""
    answers = {} if fmt is None else {"answer": grammar_text(fmt)}
    if thinking is None:
        lark = [reply_rule("reply", bool(call_rules), "answer" if answers else None), *call_rules]
        starts = ["reply"]
    else:
        # After a think block the reader drops the newlines that open the reply: an answer that
        # opens with one would reach the user without them, so only the others may follow it.
        after = None if fmt is None else after_thinking(fmt)
        after_name = None if after is None else "answer" if after == answers["answer"] else "after_answer"
        if after_name == "after_answer":
            answers[after_name] = after
        lark = [reply_rule("reply", bool(call_rules), after_name), *call_rules]
        starts = [f"<[{thinking.closes}]> {AFTER_THINKING} reply"]
    if thinking is not None and thinking.opens is not None:
        # A reply without a think block: its first token began it instead of opening one.
        first = None if fmt is None else unopened(fmt)
        if first is not None and first != answers["answer"]:
            answers["first_answer"] = first
        first_name = next((name for name, grammar in answers.items() if grammar == first), None)
        if call_rules or first_name is not None:
            lark.append(reply_rule("first_reply", bool(call_rules), first_name))
            starts.insert(0, "first_reply")
    grammars: list[dict[str, Any]] = [{"lark_grammar": "\n".join(["start: " + " | ".join(starts), *lark])}]
    for name, grammar in answers.items():
        if not any(f"@{name}" in rule.split() for rule in lark):
            continue  # the whole format, where only the answers after a think block may be given
        parts = grammar_parts(grammar)
        grammars += [{**parts[0], "name": name}, *parts[1:]]
    return json.dumps({"grammars": grammars})


def reply_rule(name: str, calls: bool, answer: str | None) -> str:
    """The rule `name`: the calls, the answer grammar named `answer`, or either."""
    return f"{name}: " + " | ".join((["calls"] if calls else []) + ([f"@{answer}"] if answer is not None else []))


def after_thinking(fmt) -> str | None:
    """The format's grammar less the answers that open with a newline, which the reader drops after
    a think block (producer_client.chat_output); None when no answer is left (a constraint_of then
    keeps the block closed). Compact JSON opens with none."""
    if isinstance(fmt, RegexFormat):
        return regex_less(fmt.pattern, "/\\n(?s:.*)/")
    if isinstance(fmt, ChoiceFormat):
        kept = [choice for choice in fmt.choices if not choice.startswith("\n")]
        return grammar_text(fmt.model_copy(update={"choices": kept})) if kept else None
    return grammar_text(fmt)


def unopened(fmt) -> str | None:
    """The format's grammar less the answers that open with `<think>` after whitespace; None when
    no answer is left. Compact JSON opens with none."""
    if isinstance(fmt, RegexFormat):
        return regex_less(fmt.pattern, THINK_OPENING)
    if isinstance(fmt, ChoiceFormat):
        kept = [choice for choice in fmt.choices if not choice.lstrip(WHITESPACE).startswith(THINK_OPEN)]
        return grammar_text(fmt.model_copy(update={"choices": kept})) if kept else None
    return grammar_text(fmt)


@functools.lru_cache(maxsize=256)
def regex_less(pattern: str, dropped: str) -> str | None:
    """The grammar of the answers of `pattern` that `dropped` (a Lark regex) does not match; None
    when none is left, as for choices: a regex cannot tell, so the grammar is built over the 256
    bytes and asked for the first byte of an answer. Cached: a format's jobs ask it twice each
    (intake.thinking_before, composed), and formats repeat."""
    grammar = f"start: ANSWER\nANSWER: /{llguidance.regex_to_lark(pattern, '')}/ & ~{dropped}"
    return grammar if answers_some(grammar) else None


def answers_some(grammar: str) -> bool:
    """Whether `grammar` matches any text: its empty answer, or a first byte it allows."""
    matcher = llguidance.LLMatcher(byte_tokenizer(), grammar)
    allowed = matcher.compute_logit_bias()
    return matcher.is_accepting() or any(allowed[: ByteVocabulary.eos_token_id])


def grammar_parts(grammar: str) -> list[dict[str, Any]]:
    """An llguidance grammar as the list of its grammars: its JSON form, or one Lark text."""
    try:
        return json.loads(grammar)["grammars"]
    except ValueError:
        return [{"lark_grammar": grammar}]
