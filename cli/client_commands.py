"""The producer's commands of `mili`: submit a job, and read, wait for or cancel it; the queue's stats.

mili submit "text" --max-tokens 32 [--stream] [--chat] [--no-thinking] [--service-tier T]    prints the job id
    [--adapter NAME]                                                        with a LoRA adapter the workers serve
    [--json | --json-schema SCHEMA | --regex PATTERN | --choice TEXT...]    structured output
mili status ID | mili result ID [--timeout S] | mili cancel ID | mili stats [--all]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from producer_client.client import Client
from producer_client.errors import InvalidArgument
from producer_client.new_job import SERVICE_TIERS


def add_commands(commands) -> None:
    """Add `submit`, `status`, `result`, `cancel` and `stats` to the `mili` parser's subcommands."""
    add_submit(commands)
    for name, run, text in (
        ("status", cmd_status, "print a job's status as JSON"),
        ("result", cmd_result, "wait for a job's result and print it as JSON"),
        ("cancel", cmd_cancel, "cancel a job; prints its status"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("job_id")
        if name == "result":
            command.add_argument("--timeout", type=float, help="seconds to wait (default: forever)")
        command.set_defaults(run=run)
    stats = commands.add_parser("stats", help="queue depth, pending, waiting, live workers")
    stats.add_argument(
        "--all",
        action="store_true",
        help="of every queue a worker served in the last hour, and of --queue's (on a cluster: on every shard)",
    )
    stats.set_defaults(run=cmd_stats)


def add_submit(commands) -> None:
    submit = commands.add_parser("submit", help="enqueue a prompt; prints the job id")
    submit.add_argument("prompt")
    submit.add_argument("--max-tokens", type=int, default=256)
    submit.add_argument("--temperature", type=float, default=1.0)
    submit.add_argument("--top-p", type=float, default=1.0)
    submit.add_argument("--top-k", type=int, default=0)
    submit.add_argument("--seed", type=int)
    submit.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    submit.add_argument("--request-id", help="idempotency key")
    submit.add_argument("--timeout-s", type=float, help="deadline, counted from the enqueue")
    submit.add_argument("--priority", type=int, default=0)
    submit.add_argument("--adapter", metavar="NAME", help="run with this LoRA adapter (one the workers serve)")
    submit.add_argument(
        "--service-tier",
        choices=tuple(SERVICE_TIERS),
        help="the job's lane: priority, default (or auto), flex (OpenAI's service_tier values)",
    )
    submit.add_argument(
        "--stream", action="store_true", help="print the text as it is generated (a chat's reasoning to stderr)"
    )
    submit.add_argument(
        "--chat", action="store_true", help="send the text as a user message, through the model's chat template"
    )
    submit.add_argument(
        "--no-thinking",
        dest="thinking",
        action="store_false",
        help="a chat with Qwen3's thinking off (implies --chat)",
    )
    structured = submit.add_mutually_exclusive_group()
    structured.add_argument(
        "--json", action="store_true", help="the output is a JSON object (response_format json_object)"
    )
    structured.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="the output matches this JSON schema: its JSON text, or @FILE to read it",
    )
    structured.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    structured.add_argument("--choice", action="append", help="the output is one of these texts (repeatable)")
    submit.set_defaults(run=cmd_submit)


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    text = {"prompt": args.prompt}
    if args.chat or not args.thinking:
        text = {"messages": [{"role": "user", "content": args.prompt}], "enable_thinking": args.thinking}
    fmt = response_format(args)
    if fmt is not None:
        text["response_format"] = fmt
    job_id = client.submit(
        **text,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        request_id=args.request_id,
        timeout_s=args.timeout_s,
        priority=args.priority,
        stream=args.stream,
        adapter=args.adapter,
        service_tier=args.service_tier,
    )
    if not args.stream:
        print(job_id)
        return 0
    print(f"job {job_id}", file=sys.stderr)
    for delta in client.stream(job_id):
        print(delta.reasoning, end="", flush=True, file=sys.stderr)
        print(delta.text, end="", flush=True)
    print()
    result = client.result(job_id)
    print(f"{result.status} ({result.finish_reason}), {result.usage.completion_tokens} tokens", file=sys.stderr)
    return 0


def response_format(args: argparse.Namespace) -> dict | None:
    """The submit's response_format, from --json, --json-schema, --regex or --choice."""
    if args.json:
        return {"type": "json_object"}
    if args.regex is not None:
        return {"type": "regex", "pattern": args.regex}
    if args.choice:
        return {"type": "choice", "choices": args.choice}
    if args.json_schema is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": read_schema(args.json_schema)}}


def read_schema(source: str) -> object:
    """--json-schema's JSON: the text given, or @FILE's. Whether it is a usable schema is the
    client's check, as for any submit."""
    if not source.startswith("@"):
        return parse_json(source, "not JSON (give the schema's JSON text, or @FILE)")
    path = Path(source[1:])
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise InvalidArgument("json_schema", f"the file {path} was not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidArgument("json_schema", f"the file {path} cannot be read: {e}") from None
    return parse_json(text, f"the file {path} is not JSON")


def parse_json(text: str, what: str) -> object:
    try:
        return json.loads(text)
    except ValueError as e:
        raise InvalidArgument("json_schema", f"{what}: {e}") from None


def cmd_status(client: Client, args: argparse.Namespace) -> int:
    print(client.status(args.job_id).model_dump_json(indent=2))
    return 0


def cmd_result(client: Client, args: argparse.Namespace) -> int:
    print(client.result(args.job_id, timeout=args.timeout).model_dump_json(indent=2))
    return 0


def cmd_cancel(client: Client, args: argparse.Namespace) -> int:
    print(client.cancel(args.job_id).model_dump_json(indent=2))
    return 0


def cmd_stats(client: Client, args: argparse.Namespace) -> int:
    if not args.all:
        print(client.queue_stats().model_dump_json(indent=2))
        return 0
    # The queue index holds a queue once a worker's heartbeat put it there: the named queue is
    # counted too, so that jobs waiting for a first worker are seen (the gateway's routed_queues).
    queues = sorted({*client.inspect.queues(), client.queue})
    every = [client.on_queue(queue).queue_stats().model_dump(mode="json") for queue in queues]
    print(json.dumps(every, indent=2))
    return 0
