"""`mili`: the producer client from a shell.

    mili submit "text" --max-tokens 32 [--stream] [--chat] [--no-thinking]    prints the job id (or streams the text)
        [--json | --json-schema SCHEMA | --regex PATTERN | --choice TEXT...]    structured output
    mili status ID | mili result ID | mili cancel ID | mili stats [--all]     (cli.client_commands)
    mili dead list|show|retry|purge | mili workers | mili jobs --status S    (cli.operator_commands)
    mili batch INPUT.jsonl -o OUTPUT.jsonl [-e ERRORS.jsonl]    an OpenAI batch file, resumable (cli.batch_command)

--redis (env MILI_REDIS) and --queue (env MILI_QUEUE) pick the queue.
"""

from __future__ import annotations

import argparse
import os
import sys

import redis

from cli import batch_command, client_commands, operator_commands
from producer_client.client import Client
from producer_client.client_base import DEFAULT_URL
from producer_client.connection import redact_url
from producer_client.errors import MiliError


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
    parser.add_argument("--redis", default=os.environ.get("MILI_REDIS", DEFAULT_URL), help="Redis URL (env MILI_REDIS)")
    parser.add_argument("--queue", default=os.environ.get("MILI_QUEUE", "default"), help="queue name (env MILI_QUEUE)")
    parser.add_argument("--prefix", default=os.environ.get("MILI_PREFIX", "mili"), help="key prefix (env MILI_PREFIX)")
    commands = parser.add_subparsers(dest="command", required=True)
    client_commands.add_commands(commands)
    batch_command.add_command(commands)
    operator_commands.add_commands(commands)
    return parser


class OneLineParser(argparse.ArgumentParser):
    """Usage errors in one line, as every other error of the CLI (the subcommands' parsers are of
    this class too)."""

    def error(self, message: str):
        self.exit(2, f"error: invalid_argument: {message} (see {self.prog} --help)\n")


if __name__ == "__main__":
    sys.exit(main())
