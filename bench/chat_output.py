"""The CPU cost of splitting a chat's output (producer_client.chat_output): what a stream reader
(the gateway, `Client.stream`) spends per token event, and the worker per finished job. The
baseline, in the same run, reads the same events unsplit (a job whose start event names no
format): the reader's cost per event before this split existed.

    .venv/bin/python -m bench.chat_output [--outputs 2000]

The output is Qwen3's shape: a think block, a sentence of answer, two tool calls, cut into
pieces of 1 to 6 characters as a byte-level vocabulary's tokens would be.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tqdm import tqdm

from producer_client.chat_output import OutputFormat, Reasoning, parse_output
from producer_client.job_stream import JobStream
from producer_client.schema import JobResult

FORMAT = OutputFormat(reasoning=Reasoning.OPTIONAL, tools=["get_weather", "search"])
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'


def output_text(rng: random.Random) -> str:
    words = [
        rng.choice(["the", "user", "asks", "about", "weather", "in", "Paris", "so", "I", "call"]) for _ in range(120)
    ]
    return f"<think>\n{' '.join(words)}.\n</think>\n\nLet me look that up.\n{CALL}\n{CALL}"


def pieces_of(text: str, rng: random.Random) -> list[str]:
    out, i = [], 0
    while i < len(text):
        size = rng.randint(1, 6)
        out.append(text[i : i + size])
        i += size
    return out


def events_of(pieces: list[str], fmt: OutputFormat | None) -> list[tuple[str, dict]]:
    """A job's events as Redis returns them: start (naming the format), one per token, end."""
    start = {"worker": "w", "started_at": 0.0, "resumed_tokens": 0}
    if fmt is not None:
        start["output"] = fmt.model_dump(mode="json")
    events = [("1-0", {"type": "start", "data": json.dumps(start)})]
    events += [
        (f"{i + 2}-0", {"type": "tokens", "data": json.dumps({"ids": [i], "text": p})}) for i, p in enumerate(pieces)
    ]
    return events + [
        (f"{len(pieces) + 2}-0", {"type": "end", "data": JobResult(id="j", status="done").model_dump_json()})
    ]


def cpu_s(run) -> float:
    start = time.process_time()
    run()
    return time.process_time() - start


def read_all(jobs: list[list[tuple[str, dict]]], label: str) -> None:
    for events in tqdm(jobs, desc=label, leave=False):
        reader = JobStream("j", "0-0")
        for event_id, fields in events:
            reader.take(event_id, fields)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    texts = [output_text(rng) for _ in range(args.outputs)]
    streams = [pieces_of(t, rng) for t in texts]
    unsplit = [events_of(p, None) for p in streams]
    split = [events_of(p, FORMAT) for p in streams]
    deltas = sum(map(len, streams))

    base = cpu_s(lambda: read_all(unsplit, "unsplit"))
    parsed = cpu_s(lambda: read_all(split, "split"))
    whole = cpu_s(lambda: [parse_output(t, FORMAT) for t in texts])
    print(
        f"{args.outputs} outputs, {deltas} token events ({deltas / args.outputs:.0f} per output, {len(texts[0])} characters)"
    )
    print(f"baseline, events read unsplit (JobStream.take): {base / deltas * 1e6:.2f} us CPU per event")
    print(f"events read and split: {parsed / deltas * 1e6:.2f} us CPU per event, {parsed / base:.2f}x the baseline")
    print(
        f"whole output split (parse_output, the worker's per job): {whole / args.outputs * 1e6:.1f} us CPU per output"
    )


if __name__ == "__main__":
    main()
