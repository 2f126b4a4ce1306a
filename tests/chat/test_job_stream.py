"""A job's events read as token deltas (producer_client.job_stream): a chat's text split by the
format its start event names, the held-back rest added at the end, and a stream resumed after
any delta's event id yielding exactly the deltas after it."""

import json

from producer_client.chat_output import OutputFormat, Reasoning
from producer_client.job_stream import JobStream
from producer_client.schema import JobResult

FORMAT = OutputFormat(reasoning=Reasoning.OPTIONAL, tools=["f"])
TEXTS = ["<thi", "nk>\nhm", "m\n</think>\n\nOK\n<tool_", 'call>{"name": "f", "arguments": {}}</tool_call>', "\nbye <"]


def events(fmt: OutputFormat | None) -> list[tuple[str, dict]]:
    start = {"worker": "w", "started_at": 1.0, "resumed_tokens": 0}
    if fmt is not None:
        start["output"] = fmt.model_dump(mode="json")
    out = [("1-0", {"type": "start", "data": json.dumps(start)})]
    out += [
        (f"{i + 2}-0", {"type": "tokens", "data": json.dumps({"ids": [i], "text": t})}) for i, t in enumerate(TEXTS)
    ]
    out.append((f"{len(TEXTS) + 2}-0", {"type": "end", "data": JobResult(id="j", status="done").model_dump_json()}))
    return out


def read(fmt: OutputFormat | None, after: str = "0-0") -> list:
    reader = JobStream("j", after)
    deltas = []
    for event_id, fields in events(fmt):
        deltas += reader.take(event_id, fields)
    assert reader.end is not None
    return deltas


def test_a_chats_deltas_carry_its_answer_reasoning_and_calls_apart():
    deltas = read(FORMAT)
    assert "".join(d.reasoning for d in deltas) == "hmm"
    assert "".join(d.text for d in deltas) == "OK\nbye <"
    assert [c.function.name for d in deltas for c in d.tool_calls] == ["f"]
    assert (
        deltas[-1].token_ids == [] and deltas[-1].text == " <"
    )  # held back until the end: it could have opened a call
    assert deltas[-1].event_id == deltas[-2].event_id  # resuming after it reads the end again


def test_a_job_without_a_format_streams_its_text_as_it_is():
    assert "".join(d.text for d in read(None)) == "".join(TEXTS)


def test_resuming_after_any_delta_yields_exactly_the_deltas_after_it():
    whole = read(FORMAT)
    for i, delta in enumerate(whole[:-1]):
        assert read(FORMAT, after=delta.event_id) == whole[i + 1 :]
