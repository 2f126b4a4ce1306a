"""The reasoning and tool-call parser, to the character: a stream's deltas, however the text is
cut, add up to the whole output's parse; generated outputs parse into exactly what generated them;
and each bug report other Qwen3 parsers collected has its test."""

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from producer_client.chat_output import (
    CALL_CLOSE,
    CALL_OPEN,
    THINK_CLOSE,
    THINK_OPEN,
    ChatOutput,
    OutputFormat,
    OutputParser,
    ParsedCall,
    Reasoning,
    parse_output,
)

TOOLS = ["get_weather", "search"]
FORMATS = [OutputFormat(reasoning=reasoning, tools=tools) for reasoning in Reasoning for tools in (None, TOOLS)]


def streamed(text_pieces: list[str], fmt: OutputFormat) -> ChatOutput:
    """The deltas of a stream fed these pieces, added up."""
    parser = OutputParser(fmt)
    deltas = [parser.push(piece) for piece in text_pieces] + [parser.finish()]
    return ChatOutput(
        "".join(d.content for d in deltas),
        "".join(d.reasoning for d in deltas),
        [c for d in deltas for c in d.tool_calls],
    )


# -- any text, cut anywhere -------------------------------------------------------------------------

FRAGMENTS = [
    THINK_OPEN,
    THINK_CLOSE,
    CALL_OPEN,
    CALL_CLOSE,
    "<",
    "</",
    "<think",
    "</thi",
    "<tool_",
    "</tool_call",
    "\n",
    "\n\n",
    " ",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "search", "arguments": {}}',
    '{"name": "nope", "arguments": {}}',
    '{"name": "search"',
    "{bad json}",
    "Hello",
    "é",
    "猫",
]
junk = st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(alphabet='ab <>/{}"\n', max_size=6)), max_size=30).map(
    "".join
)


def cuts_of(text: str, positions: list[int]) -> list[str]:
    points = sorted({p % (len(text) + 1) for p in positions})
    bounds = [0, *points, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=300, deadline=None)
@given(text=junk, fmt=st.sampled_from(FORMATS), positions=st.lists(st.integers(min_value=0), max_size=12))
def test_any_output_streamed_in_any_pieces_adds_up_to_its_whole_parse(text, fmt, positions):
    whole = parse_output(text, fmt)
    assert streamed(cuts_of(text, positions), fmt) == whole
    assert streamed(list(text), fmt) == whole  # one character at a time


@settings(max_examples=60, deadline=None)
@given(text=junk, fmt=st.sampled_from(FORMATS))
def test_every_single_cut_of_an_output_adds_up_to_its_whole_parse(text, fmt):
    whole = parse_output(text, fmt)
    for cut in range(len(text) + 1):
        assert streamed([text[:cut], text[cut:]], fmt) == whole


# -- generated outputs parse into what generated them --------------------------------------------------

words = (
    st.text(alphabet="abcdefgh ,.!?<>/é猫", min_size=1, max_size=12)
    .map(str.strip)
    .filter(bool)
    .filter(lambda t: not any(m in t for m in (THINK_OPEN, THINK_CLOSE, CALL_OPEN, CALL_CLOSE)))
)
arguments = st.dictionaries(st.sampled_from(["city", "q", "n"]), st.one_of(st.integers(), words), max_size=3)
calls = st.tuples(st.sampled_from(TOOLS), arguments)
# An answer: text and calls in any order, never two texts in a row (they would be one text).
parts = st.lists(st.one_of(words.map(lambda t: ("text", t)), calls.map(lambda c: ("call", c))), max_size=6).map(
    lambda ps: [p for i, p in enumerate(ps) if not (p[0] == "text" and i and ps[i - 1][0] == "text")]
)


def render(reasoning: str | None, answer: list[tuple]) -> str:
    """As Qwen3 writes it: the think block, then the answer's parts, one line apart."""
    lines = []
    for kind, value in answer:
        if kind == "text":
            lines.append(value)
        else:
            name, args = value
            lines.append(f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args})}\n{CALL_CLOSE}")
    think = "" if reasoning is None else f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n"
    return think + "\n".join(lines)


def expected(reasoning: str | None, answer: list[tuple]) -> ChatOutput:
    """Texts keep what separates them from earlier text; the newlines next to a call go."""
    content, tool_calls = "", []
    for kind, value in answer:
        if kind == "text":
            content += ("\n" if content else "") + value
        else:
            tool_calls.append(ParsedCall(len(tool_calls), value[0], json.dumps(value[1], ensure_ascii=False)))
    return ChatOutput(content, reasoning or "", tool_calls)


@settings(max_examples=300, deadline=None)
@given(
    reasoning=st.one_of(st.none(), st.lists(words, min_size=1, max_size=4).map("\n".join)),
    answer=parts,
    positions=st.lists(st.integers(min_value=0), max_size=10),
)
def test_a_generated_output_parses_into_its_reasoning_answer_and_calls(reasoning, answer, positions):
    text = render(reasoning, answer)
    fmt = OutputFormat(reasoning=Reasoning.OPTIONAL, tools=TOOLS)
    want = expected(reasoning, answer)
    if not answer and reasoning is None:
        want = ChatOutput("", "", [])
    assert parse_output(text, fmt) == want
    assert streamed(cuts_of(text, positions), fmt) == want


@settings(max_examples=200, deadline=None)
@given(reasoning=st.lists(words, min_size=1, max_size=4).map("\n".join), answer=parts, cut=st.integers(min_value=0))
def test_an_output_cut_off_anywhere_streams_as_its_whole_parse(reasoning, answer, cut):
    text = render(reasoning, answer)
    text = text[: cut % (len(text) + 1)]
    fmt = OutputFormat(reasoning=Reasoning.OPTIONAL, tools=TOOLS)
    whole = parse_output(text, fmt)
    assert streamed(list(text), fmt) == whole
    if THINK_OPEN in text and THINK_CLOSE not in text:  # cut inside the reasoning: it is all reasoning
        assert whole.content == "" and whole.tool_calls == []
    assert len(whole.tool_calls) == text.count(CALL_CLOSE) - reasoning.count(CALL_CLOSE)


# -- the bug reports --------------------------------------------------------------------------------

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def both(text: str, fmt: OutputFormat) -> ChatOutput:
    """The whole parse, after checking a token-by-token stream agrees (pieces of 3 characters)."""
    whole = parse_output(text, fmt)
    assert streamed([text[i : i + 3] for i in range(0, len(text), 3)], fmt) == whole
    return whole


def test_a_tool_call_drafted_inside_think_is_reasoning_not_a_call_verl_4757():
    text = (
        f"{THINK_OPEN}\nI will call A.\n{CALL_OPEN}{WEATHER}{CALL_CLOSE}\nthen use it\n{THINK_CLOSE}\n\n"
        f"{CALL_OPEN}\n{WEATHER}\n{CALL_CLOSE}"
    )
    out = both(text, OutputFormat(reasoning=Reasoning.OPTIONAL, tools=TOOLS))
    assert out.tool_calls == [ParsedCall(0, "get_weather", '{"city": "Paris"}')]
    assert out.reasoning == f"I will call A.\n{CALL_OPEN}{WEATHER}{CALL_CLOSE}\nthen use it"
    assert out.content == ""


def test_think_close_split_across_deltas_ends_the_reasoning():
    parser = OutputParser(OutputFormat(reasoning=Reasoning.OPTIONAL))
    deltas = [parser.push(p) for p in ("<think>\nhm", "m\n</", "thi", "nk>\n\nThe answer")] + [parser.finish()]
    assert [d.reasoning for d in deltas] == ["hm", "m", "", "", ""]
    assert "".join(d.content for d in deltas) == "The answer"
    assert all(THINK_CLOSE[:2] not in d.content + d.reasoning for d in deltas)


def test_tool_choice_none_leaves_tool_call_text_in_the_answer():
    # tool_choice "none" gives the parser no tools: a <tool_call> the model writes anyway is text.
    text = f"Here:\n{CALL_OPEN}\n{WEATHER}\n{CALL_CLOSE}"
    out = both(text, OutputFormat(reasoning=Reasoning.OPTIONAL, tools=None))
    assert (out.content, out.tool_calls) == (text, [])


def test_with_thinking_off_the_answer_is_content_never_reasoning_vllm_19839_qwen3_1297():
    out = both("I am Qwen3.\n\n1. Strong\n2. Fast", OutputFormat(reasoning=Reasoning.OFF, tools=TOOLS))
    assert (out.content, out.reasoning) == ("I am Qwen3.\n\n1. Strong\n2. Fast", "")
    literal = both("<think>x</think> is how I think", OutputFormat(reasoning=Reasoning.OFF))
    assert (literal.content, literal.reasoning) == ("<think>x</think> is how I think", "")


def test_thinking_on_without_a_think_block_is_all_answer():
    out = both("Paris is the capital.", OutputFormat(reasoning=Reasoning.OPTIONAL))
    assert (out.content, out.reasoning) == ("Paris is the capital.", "")


def test_a_prompt_that_opened_think_makes_the_output_start_inside_it():
    out = both("the user wants X\n</think>\n\nX.", OutputFormat(reasoning=Reasoning.OPEN))
    assert (out.reasoning, out.content) == ("the user wants X", "X.")


def test_an_output_cut_off_inside_think_is_reasoning():
    out = both("<think>\nstep one, step tw", OutputFormat(reasoning=Reasoning.OPTIONAL, tools=TOOLS))
    assert (out.reasoning, out.content, out.tool_calls) == ("step one, step tw", "", [])


def test_a_tool_call_truncated_by_max_tokens_is_text_vllm_pr_35230():
    text = f'Let me look.\n{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{"city": "Par'
    out = both(text, OutputFormat(reasoning=Reasoning.OPTIONAL, tools=TOOLS))
    assert out.tool_calls == []
    assert out.content == text


def test_malformed_json_and_unknown_functions_are_text_kept_whole():
    bad = f'{CALL_OPEN}\n{{"name": "get_weather", "arguments": {{city: Paris}}}}\n{CALL_CLOSE}'
    unknown = f'{CALL_OPEN}\n{{"name": "rm_rf", "arguments": {{}}}}\n{CALL_CLOSE}'
    nan = f'{CALL_OPEN}{{"name": "search", "arguments": {{"n": NaN}}}}{CALL_CLOSE}'
    text = f"A\n{bad}\n{CALL_OPEN}\n{WEATHER}\n{CALL_CLOSE}\n{unknown}\n{nan}"
    out = both(text, OutputFormat(reasoning=Reasoning.OFF, tools=TOOLS))
    assert out.tool_calls == [ParsedCall(0, "get_weather", '{"city": "Paris"}')]
    assert out.content == f"A\n{bad}\n{unknown}\n{nan}"


def test_parallel_calls_are_numbered_and_text_around_them_is_kept():
    search = '{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}'  # arguments given as a JSON string
    text = f"I'll check both.\n\n{CALL_OPEN}\n{WEATHER}\n{CALL_CLOSE}\n{CALL_OPEN}\n{search}\n{CALL_CLOSE}\nDone."
    out = both(text, OutputFormat(reasoning=Reasoning.OPTIONAL, tools=TOOLS))
    assert [c.index for c in out.tool_calls] == [0, 1]
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}),
        ("search", {"q": "x"}),
    ]
    assert out.content == "I'll check both.\nDone."


def test_a_call_whose_argument_holds_the_close_marker_is_one_call_issue_40():
    # Found by tests/gateway/test_structured_shapes.py: a tool's parameter spelling `</tool_call>`
    # (a const the grammar made the model write): the marker inside a JSON string is the
    # argument's text, not the call's end, so the reader split a call there and the answer was raw.
    call = '{"name": "search", "arguments": {"q": "<think></tool_call>"}}'
    text = f"{CALL_OPEN}\n{call}\n{CALL_CLOSE}\n{CALL_OPEN}\n{call}\n{CALL_CLOSE}"
    out = both(text, OutputFormat(reasoning=Reasoning.OPTIONAL, tools=TOOLS))
    assert [(c.index, c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        (0, "search", {"q": "<think></tool_call>"}),
        (1, "search", {"q": "<think></tool_call>"}),
    ]
    assert out.content == ""
