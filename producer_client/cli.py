"""`mili`: the producer client from a shell.

    mili submit "text" --max-tokens 32 [--stream] [--chat] [--no-thinking]    prints the job id (or streams the text)
        [--json | --json-schema SCHEMA | --regex PATTERN | --choice TEXT...]    structured output
    mili status ID | mili result ID | mili cancel ID | mili stats [--all]
    mili dead list|show|retry|purge | mili workers | mili jobs --status S    (producer_client.operator_cli)
    mili batch INPUT.jsonl -o OUTPUT.jsonl [-e ERRORS.jsonl]    an OpenAI batch file, resumable

--redis (env MILI_REDIS) and --queue (env MILI_QUEUE) pick the queue.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path

import redis

from producer_client.client import Client
from producer_client.connection import redact_url
from producer_client.errors import InvalidArgument, MiliError
from producer_client.operator_cli import add_commands as add_operator_commands
from producer_client.protocol import DEFAULT_URL

IN_FLIGHT = 4096  # `mili batch`'s jobs out at once: enough to keep many workers busy


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        with Client(args.redis, args.queue, prefix=args.prefix) as client:
            return args.run(client, args)
    except MiliError as e:
        print(f"error: {e.code}: {e.message}", file=sys.stderr)
        return 1
    except redis.RedisError as e:
        print(f"error: redis at {redact_url(args.redis)}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mili", description="Submit jobs to a MILI queue and read their results.")
    parser.add_argument(
        "--redis", default=os.environ.get("MILI_REDIS", DEFAULT_URL), help="Redis URL (env MILI_REDIS)"
    )
    parser.add_argument("--queue", default=os.environ.get("MILI_QUEUE", "default"), help="queue name (env MILI_QUEUE)")
    parser.add_argument("--prefix", default=os.environ.get("MILI_PREFIX", "mili"), help="key prefix (env MILI_PREFIX)")
    commands = parser.add_subparsers(dest="command", required=True)

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
    submit.add_argument("--stream", action="store_true", help="print the text as it is generated (a chat's reasoning to stderr)")
    submit.add_argument("--chat", action="store_true", help="send the text as a user message, through the model's chat template")
    submit.add_argument(
        "--no-thinking", dest="thinking", action="store_false", help="a chat with Qwen3's thinking off (implies --chat)",
    )
    structured = submit.add_mutually_exclusive_group()
    structured.add_argument("--json", action="store_true", help="the output is a JSON object (response_format json_object)")
    structured.add_argument(
        "--json-schema", metavar="SCHEMA", help="the output matches this JSON schema: its JSON text, or @FILE to read it",
    )
    structured.add_argument("--regex", metavar="PATTERN", help="the output matches this regular expression")
    structured.add_argument("--choice", action="append", help="the output is one of these texts (repeatable)")
    submit.set_defaults(run=cmd_submit)

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
        "--all", action="store_true", help="of every queue a worker served in the last hour (on a cluster: on every shard)",
    )
    stats.set_defaults(run=cmd_stats)

    batch = commands.add_parser("batch", help="run an OpenAI batch file (JSONL); run it again to resume")
    batch.add_argument("input", type=Path, help="one request a line: custom_id, method, url, body")
    batch.add_argument("-o", "--output", type=Path, required=True, help="answers, one a line (appended to)")
    batch.add_argument("-e", "--errors", type=Path, help="failed lines (default: OUTPUT with .errors.jsonl)")
    batch.add_argument(
        "--in-flight", type=positive_int, default=IN_FLIGHT, help=f"jobs submitted ahead of their answers (default {IN_FLIGHT})",
    )
    batch.set_defaults(run=cmd_batch)
    add_operator_commands(commands)
    return parser


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line, as every other error of the CLI (the subcommands' parsers are of
    this class too)."""

    def error(self, message: str):
        self.exit(2, f"error: invalid_argument: {message} (see {self.prog} --help)\n")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def cmd_submit(client: Client, args: argparse.Namespace) -> int:
    text = {"prompt": args.prompt}
    if args.chat or not args.thinking:
        text = {"messages": [{"role": "user", "content": args.prompt}], "enable_thinking": args.thinking}
    fmt = response_format(args)
    if fmt is not None:
        text["response_format"] = fmt
    job_id = client.submit(
        **text, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop=args.stop, request_id=args.request_id, timeout_s=args.timeout_s, priority=args.priority,
        stream=args.stream,
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
    source = args.json_schema
    try:
        text = Path(source[1:]).read_text() if source.startswith("@") else source
        schema = json.loads(text)
    except (OSError, ValueError) as e:
        raise InvalidArgument("json_schema", f"not a JSON schema ({type(e).__name__}: {e})") from None
    return {"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}}


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
    every = [client.on_queue(queue).queue_stats().model_dump(mode="json") for queue in client.inspect.queues()]
    print(json.dumps(every, indent=2))
    return 0


def cmd_batch(client: Client, args: argparse.Namespace) -> int:
    try:  # the OpenAI line format is the gateway's: only this command needs its extra
        from gateway.batch_file import default_errors_path, run_batch
    except ImportError as e:
        print(f"error: mili batch needs the gateway extra (pip install 'mili[gateway]'): {e}", file=sys.stderr)
        return 2

    errors = args.errors or default_errors_path(args.output)
    stop = threading.Event()

    def first_ctrl_c(signum, frame) -> None:
        stop.set()  # the run ends between two exchanges with Redis; a second Ctrl-C ends it at once
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, first_ctrl_c)
    tally = run_batch(client, args.input, args.output, errors, args.in_flight, stop)
    answered = tally.done + tally.failed + tally.done_before
    print(
        f"{answered} of {tally.lines} lines answered: {tally.done + tally.failed} now ({tally.failed} failed, in "
        f"{errors}), {tally.done_before} before", file=sys.stderr,
    )
    if tally.interrupted:
        print("interrupted: run the same command again to finish (jobs in flight run on; nothing is submitted twice)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
