"""Thinking and tool calls end to end: the official `openai` SDK drives an agent loop against a
gateway and a worker, streamed and not; the producer client and `mili batch` get the same split.

The worker is the echo engine with a token script (MILI_ECHO_SCRIPT): it says what a model with
random weights never would (a think block, a tool call), keyed on text of the rendered prompt,
so everything between its output and the client (the worker's parse, the events, the client's
stream parser, the gateway's rendering, the SDK) is the real thing."""

import json
import subprocess
import sys
import uuid

import openai
import pytest

from harness.processes import REPO
from producer_client import Client
from tests.openai_spec import check
from tests.support.gateways import GatewayProcess
from tests.support.workers import WorkerProcess

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
SEARCH = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "properties": {}}}}


def call(city: str) -> str:
    return f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n</tool_call>'


# First line whose `when` the rendered prompt holds. The echo template renders a tool's answer as
# `tool: ...` and thinking off as Qwen3 does, with an empty think block after `assistant: `.
SCRIPT = [
    {"when": 'tool: {"temperature": 21}', "say": "<think>\nThe tool says 21.\n</think>\n\nIt is 21 °C in Paris."},
    {"when": "weather in Paris", "say": "<think>\nI should look it up.\n</think>\n\n" + call("Paris")},
    {"when": "Two cities", "say": f"Checking both.\n{call('Paris')}\n{call('Lyon')}"},
    {"when": "Break it", "say": '<tool_call>\n{"name": "get_weather", "arguments": {city: Paris}}\n</tool_call>'},
    {"when": "Draft first", "say": f"<think>\nMaybe {call('Nice')}?\n</think>\n\nNo call needed."},
    {"when": "assistant: <think>", "say": "The answer is 4."},
    {"when": "What is 2+2", "say": "<think>\n2 plus 2 is 4.\n</think>\n\nThe answer is 4."},
]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def agent(redis_server, tmp_path_factory):
    """A scripted echo worker on a queue of its own, and a gateway that names it `agent`."""
    log_dir = tmp_path_factory.mktemp("agent")
    script = log_dir / "script.json"
    script.write_text(json.dumps(SCRIPT))
    queue = f"gw-agent-{uuid.uuid4().hex[:8]}"
    worker = WorkerProcess(
        redis_server.url,
        queue,
        f"{queue}-1",
        log_dir,
        model="echo",
        env={"MILI_ECHO_SCRIPT": str(script)},
    )
    gateway = GatewayProcess(
        redis_server.url, log_dir, "--models", json.dumps({"agent": queue}), "--workers-refresh-s", "0.2"
    )
    try:
        worker.start().wait_ready()
        gateway.start()
        gateway.queue = queue
        yield gateway
    finally:
        gateway.stop()
        worker.stop()


@pytest.fixture
def agent_sdk(agent):
    client = openai.OpenAI(base_url=f"{agent.url}/v1", api_key="unused", max_retries=0)
    yield client
    client.close()


def chat(sdk, **kwargs):
    """A chat completion, checked against the spec's schema before the SDK's own parse."""
    raw = sdk.chat.completions.with_raw_response.create(model="agent", max_tokens=200, **kwargs)
    check("CreateChatCompletionResponse", json.loads(raw.text))
    return raw.parse()


def test_an_agent_loop_calls_the_tool_and_answers_with_its_result(agent_sdk):
    messages = list(ASK_WEATHER)
    first = chat(agent_sdk, messages=messages, tools=[WEATHER, SEARCH])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "I should look it up."
    (tool_call,) = choice.message.tool_calls
    assert (tool_call.type, tool_call.function.name) == ("function", "get_weather")
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert tool_call.id.startswith("call_")

    messages.append(choice.message)  # sent back as the SDK returned it: refusal null, reasoning_content
    messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": json.dumps({"temperature": 21})})
    second = chat(agent_sdk, messages=messages, tools=[WEATHER, SEARCH]).choices[0]
    assert (second.finish_reason, second.message.content) == ("stop", "It is 21 °C in Paris.")
    assert second.message.reasoning_content == "The tool says 21."
    assert second.message.tool_calls is None


def test_a_streamed_agent_loop_gets_the_same_calls_through_the_sdks_stream_helper(agent_sdk):
    messages = list(ASK_WEATHER)
    with agent_sdk.chat.completions.stream(model="agent", messages=messages, tools=[WEATHER]) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        first = stream.get_final_completion().choices[0]
    (tool_call,) = first.message.tool_calls
    assert first.finish_reason == "tool_calls"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris"}
    assert first.message.reasoning_content == "I should look it up."
    parts = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert [(p.index, p.id, p.function.name) for p in parts] == [(0, tool_call.id, "get_weather"), (0, None, None)]
    assert "".join(p.function.arguments for p in parts) == tool_call.function.arguments
    for chunk in chunks:
        check("CreateChatCompletionStreamResponse", chunk.to_dict())

    messages += [
        first.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": tool_call.id, "content": '{"temperature": 21}'},
    ]
    stream = agent_sdk.chat.completions.create(model="agent", messages=messages, tools=[WEATHER], stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    assert "".join(d.content or "" for d in deltas) == "It is 21 °C in Paris."
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "The tool says 21."


def test_thinking_on_and_off_split_the_reasoning_or_leave_none(agent_sdk):
    question = [{"role": "user", "content": "What is 2+2?"}]
    on = chat(agent_sdk, messages=question).choices[0].message
    off = (
        chat(agent_sdk, messages=question, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        .choices[0]
        .message
    )
    assert (on.reasoning_content, on.content) == ("2 plus 2 is 4.", "The answer is 4.")
    assert (off.reasoning_content, off.content) == (None, "The answer is 4.")


def test_thinking_off_goes_through_qwen3s_own_template(sdk):
    """On `tiny` (the real Qwen3 template and tokenizer): off adds the empty think block to the
    prompt, 4 tokens (`<think>`, `\\n\\n`, `</think>`, `\\n\\n`), and nothing lands in reasoning."""
    question = [{"role": "user", "content": "Name a prime number."}]
    on = sdk.chat.completions.create(model="tiny", messages=question, max_tokens=3, temperature=0)
    off = sdk.chat.completions.create(
        model="tiny",
        messages=question,
        max_tokens=3,
        temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert off.usage.prompt_tokens - on.usage.prompt_tokens == 4
    assert off.choices[0].message.reasoning_content is None


def test_parallel_calls_stream_one_index_each_and_parallel_tool_calls_false_stops_at_the_first(agent_sdk):
    ask = [{"role": "user", "content": "Two cities, please."}]
    both = agent_sdk.chat.completions.create(model="agent", messages=ask, tools=[WEATHER], stream=True)
    parts = [tc for c in both if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [p.index for p in parts] == [0, 0, 1, 1]
    assert [json.loads(p.function.arguments)["city"] for p in parts if p.function.arguments] == ["Paris", "Lyon"]

    one = chat(agent_sdk, messages=ask, tools=[WEATHER], parallel_tool_calls=False).choices[0]
    assert one.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments)["city"] for c in one.message.tool_calls] == ["Paris"]
    assert one.message.content == "Checking both."


def test_tool_choice_none_returns_a_call_the_model_writes_anyway_as_text(agent_sdk):
    choice = chat(agent_sdk, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none").choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == call("Paris")


def test_malformed_calls_and_calls_drafted_while_thinking_are_not_calls(agent_sdk):
    broken = chat(agent_sdk, messages=[{"role": "user", "content": "Break it"}], tools=[WEATHER]).choices[0]
    assert (broken.finish_reason, broken.message.tool_calls) == ("stop", None)
    assert broken.message.content == SCRIPT[3]["say"]
    drafted = chat(agent_sdk, messages=[{"role": "user", "content": "Draft first"}], tools=[WEATHER]).choices[0]
    assert (drafted.finish_reason, drafted.message.content, drafted.message.tool_calls) == (
        "stop",
        "No call needed.",
        None,
    )
    assert drafted.message.reasoning_content == f"Maybe {call('Nice')}?"


def test_an_output_cut_off_inside_think_is_reasoning_with_finish_reason_length(agent_sdk):
    choice = agent_sdk.chat.completions.create(
        model="agent", messages=ASK_WEATHER, tools=[WEATHER], max_tokens=16
    ).choices[0]
    assert choice.finish_reason == "length"
    assert (choice.message.content, choice.message.tool_calls) == ("", None)
    assert choice.message.reasoning_content == "I should"  # "<think>\nI should": 16 bytes, one token each


def test_the_producer_client_gets_reasoning_and_tool_calls_whole_and_streamed(agent, redis_server):
    with Client(redis_server.url, agent.queue) as client:
        job_id = client.submit(messages=ASK_WEATHER, tools=[WEATHER], max_tokens=200)
        deltas = list(client.stream(job_id))
        result = client.result(job_id, timeout=10)
        off = client.generate(
            messages=[{"role": "user", "content": "What is 2+2?"}], enable_thinking=False, max_tokens=50
        )
    assert (result.status, result.finish_reason, result.text, result.reasoning) == (
        "done",
        "tool_calls",
        "",
        "I should look it up.",
    )
    (tool_call,) = result.tool_calls
    assert (tool_call.function.name, json.loads(tool_call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert "".join(d.reasoning for d in deltas) == result.reasoning
    assert [c for d in deltas for c in d.tool_calls] == result.tool_calls
    assert (off.text, off.reasoning) == ("The answer is 4.", "")


def test_mili_batch_answers_lines_with_tools(agent, redis_server, tmp_path):
    lines = [
        {
            "custom_id": "weather",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "agent", "messages": ASK_WEATHER, "tools": [WEATHER]},
        },
        {
            "custom_id": "math",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "agent", "messages": [{"role": "user", "content": "What is 2+2?"}]},
        },
    ]
    source, answers = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "cli",
            "--redis",
            redis_server.url,
            "--queue",
            agent.queue,
            "batch",
            str(source),
            "-o",
            str(answers),
        ],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=120,
    )
    bodies = {a["custom_id"]: a["response"]["body"] for a in map(json.loads, answers.read_text().splitlines())}
    for body in bodies.values():
        check("CreateChatCompletionResponse", body)
    weather = bodies["weather"]["choices"][0]
    assert weather["finish_reason"] == "tool_calls"
    assert weather["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert bodies["math"]["choices"][0]["message"]["reasoning_content"] == "2 plus 2 is 4."


def test_mili_submit_chats_with_thinking_on_or_off(agent, redis_server):
    def submit(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "cli",
                "--redis",
                redis_server.url,
                "--queue",
                agent.queue,
                "submit",
                "What is 2+2?",
                "--stream",
                *flags,
            ],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
            timeout=60,
        )

    on, off = submit("--chat"), submit("--no-thinking")
    assert on.stdout == off.stdout == "The answer is 4.\n"
    assert "2 plus 2 is 4." in on.stderr and "2 plus 2" not in off.stderr
