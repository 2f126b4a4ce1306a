"""`mili batch INPUT.jsonl -o OUTPUT.jsonl [-e ERRORS.jsonl] [--in-flight N]`: the command's
arguments, Ctrl-C and summary. Its runner (cli.batch_file) is imported only when the command runs:
OpenAI's request and response models (openai_format) are slower to import than all the rest of
`mili`, which its other commands need not wait for."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path

from producer_client.client import Client

IN_FLIGHT = 4096  # `mili batch`'s jobs out at once: enough to keep many workers busy


def add_command(commands) -> None:
    """Add `batch` to the `mili` parser's subcommands."""
    batch = commands.add_parser("batch", help="run an OpenAI batch file (JSONL); run it again to resume")
    batch.add_argument("input", type=Path, help="one request a line: custom_id, method, url, body")
    batch.add_argument("-o", "--output", type=Path, required=True, help="answers, one a line (appended to)")
    batch.add_argument("-e", "--errors", type=Path, help="failed lines (default: OUTPUT with .errors.jsonl)")
    batch.add_argument(
        "--in-flight",
        type=positive_int,
        default=IN_FLIGHT,
        help=f"jobs submitted ahead of their answers (default {IN_FLIGHT})",
    )
    batch.set_defaults(run=cmd_batch)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def cmd_batch(client: Client, args: argparse.Namespace) -> int:
    from cli.batch_file import default_errors_path, run_batch

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
        f"{errors}), {tally.done_before} before",
        file=sys.stderr,
    )
    if tally.interrupted:
        print(
            "interrupted: run the same command again to finish (jobs in flight run on; nothing is submitted twice)",
            file=sys.stderr,
        )
        return 130
    return 0
