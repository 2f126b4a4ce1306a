"""`mili`: the producer client from a shell.

    mili submit "text" --max-tokens 32 [--stream] [--chat] [--no-thinking]    prints the job id (or streams the text)
        [--json | --json-schema SCHEMA | --regex PATTERN | --choice TEXT...]    structured output
    mili status ID | mili result ID | mili cancel ID | mili stats [--all]     (cli.client_commands)
    mili dead list|show|retry|purge | mili workers | mili jobs --status S    (cli.operator_commands)
    mili quota set TENANT [--max-waiting N] [--rpm N] [--tpm N] [--weight W] | mili quota show    (cli.quota_commands)
    mili batch INPUT.jsonl -o OUTPUT.jsonl [-e ERRORS.jsonl]    an OpenAI batch file, resumable (cli.batch_command)

--redis (env MILI_REDIS) and --queue (env MILI_QUEUE) pick the queue, --tenant (env MILI_TENANT)
who submits. A command first checks that Redis answers, within --connect-timeout (env
MILI_CONNECT_TIMEOUT_S, 1.5 s): an unreachable Redis is an error at once, with its cause, and not
after the retries that carry a command across a failover.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import redis
import redis.exceptions

from cli import batch_command, client_commands, operator_commands, quota_commands
from producer_client.arguments import OneLineParser
from producer_client.client import Client
from producer_client.client_base import DEFAULT_URL
from producer_client.connection import (
    PROBE_TIMEOUT_S,
    RedisURL,
    Unreachable,
    describe,
    parse_url,
    probe,
    redact_url,
    server_of_url,
)
from producer_client.errors import CredentialsRefused, MiliError, PermissionDenied, RedisRefused, RedisUnavailable


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(values_joined_to_flags(parser, sys.argv[1:] if argv is None else argv))
    try:
        code = run(args)
        sys.stdout.flush()  # a reader that left shows here, not in the interpreter's flush at exit
        return code
    except BrokenPipeError:
        return reader_left()
    except OSError as e:  # stdout's: the files commands name are InvalidArgument already (batch, --json-schema @FILE)
        return output_failed(e)


def values_joined_to_flags(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`--older-than -1d`, `--regex -?[0-9]+`, `--stop -END` as `--FLAG=VALUE`: argparse takes a
    value that begins with '-' (and is no negative number) for a flag, and said only "expected one
    argument"; joined, the value reaches the flag's own check (a duration must be positive) or is
    taken as given. A token that is one of mili's flags is left apart: a value forgotten before
    the next flag stays an error. Nothing after `--` is touched."""
    takes_value = flags_taking_one_value(parser)
    joined: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--":
            return [*joined, token, *tokens]
        joined.append(token)
        if token in takes_value:
            value = next(tokens, None)
            if value is None:
                break
            if value.startswith("-") and value.split("=", 1)[0] not in every_flag(parser):
                joined[-1] = f"{token}={value}"
            else:
                joined.append(value)
    return joined


def flags_taking_one_value(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings of mili's parsers (subcommands' included) that take one value in every
    parser that has them."""
    one, other = set(), set()
    for action in parser_actions(parser):
        (one if action.nargs is None else other).update(action.option_strings)
    return one - other


def every_flag(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser_actions(parser) for flag in action.option_strings}


def parser_actions(parser: argparse.ArgumentParser):
    for action in parser._actions:  # argparse has no public walk over a parser's arguments
        yield action
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                yield from parser_actions(subparser)


def run(args: argparse.Namespace) -> int:
    try:
        first_check(args.redis, args.connect_timeout)
        with Client(
            args.redis, args.queue, prefix=args.prefix, tenant=args.tenant, queue_shards=args.queue_shards
        ) as client:
            return args.run(client, args)
    except MiliError as e:
        print(one_line(f"error: {e.code}: {e.message}"), file=sys.stderr)
        return 1
    except redis.RedisError as e:
        print(one_line(f"error: redis at {redact_url(args.redis)}: {describe(e)}"), file=sys.stderr)
        return 1


def first_check(url: str, timeout_s: float) -> None:
    """One try of Redis within `timeout_s` (probe), before the command's calls, which retry for
    seconds. Redis unreachable, refusing the URL's credentials or the user's PING is the typed
    error the client's calls raise for it (RedisUnavailable, CredentialsRefused, PermissionDenied),
    so it reads as theirs does; any other error reply (a cluster URL of one server, a database it
    does not have) is RedisRefused, with Redis's reason."""
    try:
        probe(url, timeout_s)
    except Unreachable as e:
        raise RedisUnavailable(server_of_url(parse_url(url)), str(e)) from e
    except redis.AuthenticationError as e:
        raise CredentialsRefused(server_of_url(parse_url(url)), credentials_refusal(parse_url(url), e)) from e
    except PermissionDenied:
        raise  # the client's own, naming the command (a cluster's CLUSTER SLOTS)
    except redis.exceptions.NoPermissionError as e:
        raise PermissionDenied("a new connection's first commands (its set-up and a PING)", str(e)) from e
    except redis.ResponseError as e:
        raise RedisRefused(server_of_url(parse_url(url)), str(e)) from e


def credentials_refusal(target: RedisURL, error: redis.AuthenticationError) -> str:
    """Redis's reason, led by the cause where the URL gives no password: Redis's NOAUTH to a new
    connection's HELLO speaks of HELLO's options, not of the password it wants."""
    if "password" in target.options:
        return str(error)
    return f"it wants a password and the URL gives none ({error})"


def one_line(text: str) -> str:
    """An error as the one line the CLI promises: a message of several lines (the grammar
    library's for a bad --regex draws a caret under the pattern) has its lines joined by " | "."""
    return " | ".join(line.strip() for line in text.splitlines() if line.strip())


def shard_count(text: str) -> int | str:
    """`--queue-shards` (or MILI_QUEUE_SHARDS, which a worker beside it may read as "auto"): a count
    as a number, anything else as given, for the client to accept ("auto") or refuse with
    invalid_argument, rather than a traceback from int()."""
    return int(text) if text.isascii() and text.isdigit() else text


def reader_left() -> int:
    """stdout's reader closed it (`mili workers | head`): end quietly, as a Unix tool that SIGPIPE
    ends, with its exit status (128 + SIGPIPE). What is left to flush goes nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def output_failed(error: OSError) -> int:
    """stdout could not be written (`mili jobs > jobs.txt` on a full disk): the CLI's one-line
    error, exit 1, where it was a traceback. What is left to flush goes nowhere, as reader_left's."""
    print(one_line(f"error: output: {error.strerror or error}"), file=sys.stderr)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    return 1


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mili", description="Submit jobs to a MILI queue and read their results.")
    parser.add_argument("--redis", default=os.environ.get("MILI_REDIS", DEFAULT_URL), help="Redis URL (env MILI_REDIS)")
    parser.add_argument("--queue", default=os.environ.get("MILI_QUEUE", "default"), help="queue name (env MILI_QUEUE)")
    parser.add_argument("--prefix", default=os.environ.get("MILI_PREFIX", "mili"), help="key prefix (env MILI_PREFIX)")
    parser.add_argument(
        "--connect-timeout",
        metavar="S",
        type=positive_seconds,
        default=os.environ.get("MILI_CONNECT_TIMEOUT_S", str(PROBE_TIMEOUT_S)),
        help=f"seconds Redis has to answer before a command gives up (env MILI_CONNECT_TIMEOUT_S, {PROBE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--tenant", default=os.environ.get("MILI_TENANT"), help="who submits: its share and limits (env MILI_TENANT)"
    )
    parser.add_argument(
        "--queue-shards",
        metavar="N|auto",
        type=shard_count,
        default=shard_count(os.environ.get("MILI_QUEUE_SHARDS", "1")),
        help="spread submitted jobs over the queue's N shards; N must be the queue's count; auto: the count the "
        "queue has (env MILI_QUEUE_SHARDS, 1)",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    client_commands.add_commands(commands)
    batch_command.add_command(commands)
    operator_commands.add_commands(commands)
    quota_commands.add_commands(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
