"""A chat job's result as the worker builds it (worker.loop.jobs.Job): its output split into answer,
reasoning and tool calls, `tool_calls` as its finish reason, and with parallel_tool_calls off, a
job resumed after its one call was recorded ends there."""

import json

from producer_client.chat import tool_call_id
from producer_client.chat_output import OutputFormat, Reasoning
from producer_client.schema import JobRequest
from worker.loop.jobs import Job

WEATHER = {"type": "function", "function": {"name": "get_weather"}}
FORMAT = OutputFormat(reasoning=Reasoning.OPTIONAL, tools=["get_weather"])
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def job(parallel: bool = True) -> Job:
    request = JobRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], "parallel_tool_calls": parallel},
    )
    return Job("job-1", "1-0", "run", request, [1, 2], queued_at=0.0, started_at=0.0, output_format=FORMAT)


def recorded(*texts: str) -> list[tuple[str, dict]]:
    start = ("1-0", {"type": "start", "data": json.dumps({"worker": "w", "started_at": 0.0, "resumed_tokens": 0})})
    return [start] + [
        (f"{i + 2}-0", {"type": "tokens", "data": json.dumps({"ids": [i], "text": t})}) for i, t in enumerate(texts)
    ]


def test_a_chats_result_is_split_and_ends_for_its_calls():
    j = job()
    j.text = ["<think>\nhm\n</think>\n\nSure.\n", CALL]
    result = j.result("done", "stop", "w", 1.0)
    assert (result.text, result.reasoning, result.finish_reason) == ("Sure.", "hm", "tool_calls")
    assert [(c.id, c.function.name, c.function.arguments) for c in result.tool_calls] == [
        (tool_call_id("job-1", 0), "get_weather", '{"city": "Paris"}'),
    ]
    assert j.result("done", "length", "w", 1.0).finish_reason == "length"  # cut short: the calls made still count


def test_with_parallel_tool_calls_off_a_job_resumed_after_its_call_has_nothing_left_to_run():
    made, making = job(parallel=False), job(parallel=False)
    made.resume(recorded("Sure.\n", CALL[:20], CALL[20:]))
    making.resume(recorded("Sure.\n", CALL[:20]))
    assert (made.called_before, making.called_before) == (True, False)
    assert making.watch_for_call(CALL[20:])
    parallel = job(parallel=True)
    parallel.resume(recorded(CALL))
    assert not parallel.called_before
