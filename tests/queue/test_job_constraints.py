"""What the worker holds a job's output to (worker.loop.intake.constraint_of): its response_format, the
calls a forced tool_choice asks for, a call or the formatted answer under "auto", nothing else;
after Qwen3's reasoning when the chat thinks. The echo engine, which cannot, refuses them."""

import json

import pytest

from producer_client.chat_output import OutputFormat, Reasoning
from producer_client.errors import InvalidArgument
from producer_client.schema import JobRequest, SamplingParams
from producer_client.structured import format_from_json, grammar_text
from worker.engine.echo import EchoEngine
from worker.engine.grammar.constraint import Thinking
from worker.engine.settings import EngineSettings
from worker.loop.intake import constraint_of
from worker.model.presets import resolve_model_path
from worker.model.tokenizer import Tokenizer

THINK_OPEN, THINK_CLOSE = 151667, 151668
FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}},
}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_dir(resolve_model_path("tiny"))


def job(**fields) -> JobRequest:
    params = {"response_format": fields.pop("response_format")} if "response_format" in fields else {}
    return JobRequest.model_validate({"messages": CHAT, "params": params, **fields})


@pytest.mark.parametrize(
    "fields",
    [{}, {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "auto"}, {"tools": [TOOL], "tool_choice": "none"}],
)
def test_a_free_job_has_no_constraint(tokenizer, fields):
    assert constraint_of(job(**fields), OutputFormat(), tokenizer) is None


@pytest.mark.parametrize(
    "reasoning, thinking",
    [
        (Reasoning.OFF, None),
        (Reasoning.OPTIONAL, (THINK_CLOSE, THINK_OPEN)),
        (Reasoning.OPEN, (THINK_CLOSE, None)),
    ],
)
def test_a_format_holds_after_the_reasoning_the_chat_may_write(tokenizer, reasoning, thinking):
    constraint = constraint_of(job(response_format=FORMAT), OutputFormat(reasoning=reasoning), tokenizer)
    assert constraint.field == "response_format"
    got = constraint.thinking and (constraint.thinking.closes, constraint.thinking.opens)
    assert got == thinking


def test_a_format_with_tool_choice_none_is_the_format_alone(tokenizer):
    constraint = constraint_of(job(response_format=FORMAT, tools=[TOOL], tool_choice="none"), OutputFormat(), tokenizer)
    assert constraint.field == "response_format" and "tool_call" not in constraint.grammar


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "f"}}])
def test_a_forced_tool_choice_holds_the_output_to_calls(tokenizer, choice):
    constraint = constraint_of(job(tools=[TOOL], tool_choice=choice, response_format=FORMAT), OutputFormat(), tokenizer)
    grammar = json.loads(constraint.grammar)["grammars"]
    assert constraint.field == "tools" and len(grammar) == 1  # the calls, and no answer beside them
    assert grammar[0]["lark_grammar"].startswith("start: reply\nreply: calls\n")


def test_tools_under_auto_with_a_format_allow_a_call_or_the_answer(tokenizer):
    constraint = constraint_of(job(tools=[TOOL], response_format=FORMAT), OutputFormat(), tokenizer)
    grammar = json.loads(constraint.grammar)["grammars"]
    assert grammar[0]["lark_grammar"].startswith("start: reply\nreply: calls | @answer\n")
    assert grammar[1]["name"] == "answer"


def test_a_prompt_job_has_no_reasoning_to_skip(tokenizer):
    request = JobRequest.model_validate({"prompt": "x", "params": {"response_format": FORMAT}})
    assert constraint_of(request, None, tokenizer).thinking is None


def test_the_echo_engine_refuses_what_it_cannot_hold_to_a_grammar():
    engine = EchoEngine(EngineSettings())
    with pytest.raises(InvalidArgument) as refused:
        engine.add_request("a", [104, 105], SamplingParams(response_format={"type": "json_object"}))
    assert refused.value.field == "response_format"
    assert not engine.has_unfinished()


NEWLINE_CHOICES = {"type": "choice", "choices": ["\n", "\nyes", "no"]}


def named_grammars(constraint) -> dict[str, str]:
    return {g["name"]: g["lark_grammar"] for g in json.loads(constraint.grammar)["grammars"] if "name" in g}


def test_after_a_think_block_only_the_answers_the_reader_gives_whole_may_follow(tokenizer):
    # The reader drops the newlines that open a reply after </think> (producer_client.chat_output):
    # "\n" and "\nyes" would reach the user as "" and "yes", neither a choice (hypothesis found the
    # first in CI). Without a think block each may open the output.
    request = job(response_format=NEWLINE_CHOICES)
    constraint = constraint_of(request, OutputFormat(reasoning=Reasoning.OPTIONAL), tokenizer)
    assert constraint.thinking == Thinking(THINK_CLOSE, THINK_OPEN)
    main = json.loads(constraint.grammar)["grammars"][0]["lark_grammar"]
    assert main.startswith(f"start: first_reply | <[{THINK_CLOSE}]> /\\n{{0,4}}/ reply\nreply: @after_answer\n")
    assert named_grammars(constraint) == {
        "answer": 'start: "\\n" | "\\nyes" | "no"',
        "after_answer": 'start: "no"',
    }


NEWLINE_OPENED = [{"type": "choice", "choices": ["\n", "\nyes"]}, {"type": "regex", "pattern": "\n[a-z]+|\n"}]


@pytest.mark.parametrize("fmt", NEWLINE_OPENED, ids=["choice", "regex"])
@pytest.mark.parametrize("reasoning", [Reasoning.OPTIONAL, Reasoning.OPEN])
def test_a_format_whose_every_answer_opens_with_a_newline_keeps_the_think_block_closed(tokenizer, reasoning, fmt):
    # A regex's answers are found as a choice's are: on main its grammar after the think block was
    # one that matched nothing, and the block was left open.
    request = job(response_format=fmt)
    if reasoning is Reasoning.OPEN:  # the prompt opened the block: no answer can follow it
        with pytest.raises(InvalidArgument) as refused:
            constraint_of(request, OutputFormat(reasoning=reasoning), tokenizer)
        assert refused.value.field == "response_format"
        return
    constraint = constraint_of(request, OutputFormat(reasoning=reasoning), tokenizer)
    assert constraint.thinking is None  # the grammar holds from the first token: the answer whole
    assert constraint.grammar == grammar_text(format_from_json(json.dumps(fmt)))


def test_a_regex_whose_every_answer_opens_a_think_block_is_no_reply_without_one(tokenizer):
    # The reader takes such an output for reasoning: the output must open the block, as it must
    # for such choices; on main the reply without one was a grammar that matched nothing.
    fmt = {"type": "regex", "pattern": " ?<think>[a-z]+"}
    constraint = constraint_of(job(response_format=fmt), OutputFormat(reasoning=Reasoning.OPTIONAL), tokenizer)
    main = json.loads(constraint.grammar)["grammars"][0]["lark_grammar"]
    assert main == f"start: <[{THINK_CLOSE}]> /\\n{{0,4}}/ reply\nreply: @after_answer"
    assert list(named_grammars(constraint)) == ["after_answer"]
