"""A chat job's prompt through Qwen3's own chat template (worker.loop.intake.render_prompt): the thinking
switch, the tools offered (all, none, or the one named), tool calls, reasoning and tool answers in
the history; and the output format the worker derives from it."""

import json

import pytest

from producer_client.chat_output import OutputFormat, Reasoning
from producer_client.schema import JobRequest
from worker.loop.intake import reasoning_of, render_prompt
from worker.model.tokenizer import Tokenizer

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir)


def rendered(tokenizer: Tokenizer, **request) -> tuple[str, OutputFormat]:
    ids, fmt = render_prompt(JobRequest.model_validate(request), tokenizer)
    return tokenizer.decode(ids), fmt


def test_thinking_on_leaves_the_think_block_to_the_model_and_off_closes_it_empty(tokenizer):
    on, on_format = rendered(tokenizer, messages=ASK)
    off, off_format = rendered(tokenizer, messages=ASK, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and off == on + "<think>\n\n</think>\n\n"
    assert (on_format, off_format) == (
        OutputFormat(reasoning=Reasoning.OPTIONAL),
        OutputFormat(reasoning=Reasoning.OFF),
    )


def test_tools_are_rendered_all_none_or_the_named_one(tokenizer):
    auto, auto_format = rendered(tokenizer, messages=ASK, tools=[WEATHER, SEARCH])
    none, none_format = rendered(tokenizer, messages=ASK, tools=[WEATHER, SEARCH], tool_choice="none")
    named, named_format = rendered(
        tokenizer,
        messages=ASK,
        tools=[WEATHER, SEARCH],
        tool_choice={"type": "function", "function": {"name": "search"}},
    )
    assert f"<tools>\n{json.dumps(WEATHER)}\n{json.dumps(SEARCH)}\n</tools>" in auto
    assert "<tools>" not in none and none == rendered(tokenizer, messages=ASK)[0]
    assert f"<tools>\n{json.dumps(SEARCH)}\n</tools>" in named
    assert (auto_format.tools, none_format.tools, named_format.tools) == (["get_weather", "search"], None, ["search"])


def test_a_tool_loops_history_renders_the_calls_their_answers_and_the_last_reasoning(tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    text, _ = rendered(tokenizer, messages=messages, tools=[WEATHER])
    assert text.endswith(
        "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
    )


def test_a_prompt_that_opens_think_starts_the_output_inside_it():
    assert reasoning_of(True, "<|im_start|>assistant\n<think>\n") is Reasoning.OPEN
    assert reasoning_of(True, "<|im_start|>assistant\n") is Reasoning.OPTIONAL
    assert reasoning_of(False, "<|im_start|>assistant\n<think>\n") is Reasoning.OFF
