"""What a user of the `mili` CLI sees: a reader that leaves early ends it quietly, and an argument
it cannot use says which and why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from cli.__main__ import main
from harness.processes import REPO
from producer_client import Client
from tests.support.jobs import entries_added

CLOSED_PIPE_EXIT = 128 + signal.SIGPIPE


def mili_into_a_closed_pipe(url: str, *args: str) -> subprocess.CompletedProcess:
    """`mili ARGS | head` once head has left: stdout is a pipe nobody reads."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return mili_writing_to(write_end, url, *args)
    finally:
        os.close(write_end)


def mili_writing_to(stdout: int, url: str, *args: str) -> subprocess.CompletedProcess:
    """`mili --redis URL ARGS` with its stdout on the file descriptor `stdout`, its stderr read."""
    return subprocess.run(
        [sys.executable, "-m", "cli", "--redis", url, *args],
        cwd=REPO,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_reader_that_left_ends_the_command_quietly(redis_server, queue):
    with Client(redis_server.url, queue) as client:
        job_id = client.submit("piped", max_tokens=4)
    status = mili_into_a_closed_pipe(redis_server.url, "--queue", queue, "status", job_id)
    assert (status.returncode, status.stderr) == (CLOSED_PIPE_EXIT, "")


def test_a_closed_stdout_does_not_hide_an_error(redis_server):
    missing = mili_into_a_closed_pipe(redis_server.url, "status", "no-such-job")
    assert (missing.returncode, missing.stderr) == (
        1,
        "error: not_found: job 'no-such-job' not found (never submitted, or its result expired)\n",
    )


@pytest.mark.parametrize("args", [("stats",), ("workers",), ("jobs", "--status", "queued"), ("status", "JOB")])
def test_an_output_that_cannot_be_written_is_one_line_on_stderr(redis_server, queue, args):
    """`mili jobs > jobs.txt` on a full disk (here stdout is /dev/full: every write ENOSPC) ended
    with a Python traceback of the OSError; it is the CLI's one-line error, exit 1."""
    with Client(redis_server.url, queue) as client:
        job_id = client.submit("unread", max_tokens=4)  # no worker serves this queue
    with open("/dev/full", "w") as full:  # Linux's; the suite runs on Linux (no skip: a check never goes silent)
        done = mili_writing_to(
            full.fileno(), redis_server.url, "--queue", queue, *(job_id if arg == "JOB" else arg for arg in args)
        )
    assert (done.returncode, done.stderr) == (1, "error: output: No space left on device\n")


def submit_with_schema(url: str, schema: str, capsys) -> tuple[int, str]:
    code = main(["--redis", url, "submit", "x", "--max-tokens", "4", "--json-schema", schema])
    return code, capsys.readouterr().err


def test_a_schema_file_that_is_not_there_is_named(redis_server, tmp_path, capsys):
    missing = tmp_path / "nofile.json"
    assert submit_with_schema(redis_server.url, f"@{missing}", capsys) == (
        1,
        f"error: invalid_argument: json_schema: the file {missing} was not found\n",
    )


def test_a_schema_file_that_is_not_json_says_where(redis_server, tmp_path, capsys):
    broken = tmp_path / "broken.json"
    broken.write_text('{"type": "object",\n "properties": }')
    cause = "Expecting value: line 2 column 16 (char 34)"
    assert submit_with_schema(redis_server.url, f"@{broken}", capsys) == (
        1,
        f"error: invalid_argument: json_schema: the file {broken} is not JSON: {cause}\n",
    )


def test_a_schema_text_that_is_not_json_says_so(redis_server, capsys):
    cause = "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"
    assert submit_with_schema(redis_server.url, "{type: object}", capsys) == (
        1,
        f"error: invalid_argument: json_schema: not JSON (give the schema's JSON text, or @FILE): {cause}\n",
    )


BATCH_LINE = (
    '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "echo", "prompt": "x"}}\n'
)


def test_an_error_of_several_lines_is_said_in_one(redis_server, redis_client, queue, capsys):
    """The grammar library's message for a bad pattern draws a caret under it, over five lines:
    the CLI says it in one, and enqueues nothing."""
    code = main(["--redis", redis_server.url, "--queue", queue, "submit", "x", "--regex", "("])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1, err
    assert err.startswith("error: invalid_argument: response_format.pattern: the grammar library refuses it: ")
    assert "unclosed group" in err
    assert entries_added(redis_client, queue) == 0


def test_batch_files_it_cannot_use_are_named_before_any_line_is_submitted(
    redis_server, redis_client, queue, tmp_path, capsys
):
    """An input that is not there, a directory, a line that is not UTF-8 (the Batch API refuses such
    an upload whole), blank lines only (the Batch API's `empty_file`: a run that ended "0 of 0 lines
    answered", exit 0), an output it cannot create: one line naming the argument, exit 1, no output
    file left behind for a wrong input, and no job enqueued for any of them."""
    good = tmp_path / "good.jsonl"
    good.write_text(BATCH_LINE)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(BATCH_LINE.encode() + b'{"custom_id": "caf\xe9"}\n')
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n\r\n\t\n")
    out = tmp_path / "out.jsonl"
    cases = {
        (tmp_path / "nofile.jsonl", out): f"input: {tmp_path / 'nofile.jsonl'}: No such file or directory",
        (tmp_path, out): f"input: {tmp_path}: Is a directory",
        (latin1, out): f"input: {latin1}: line 2 is not UTF-8 text (invalid continuation byte at byte 18)",
        (blank, out): f"input: {blank}: holds no request: it is empty or its lines are all blank",
        (good, tmp_path / "no" / "out.jsonl"): f"output: {tmp_path / 'no' / 'out.jsonl'}: No such file or directory",
    }
    for (source, output), message in cases.items():
        code = main(["--redis", redis_server.url, "--queue", queue, "batch", str(source), "-o", str(output)])
        assert (code, capsys.readouterr().err) == (1, f"error: invalid_argument: {message}\n")
        assert not out.exists()
    assert entries_added(redis_client, queue) == 0


def test_an_abbreviated_or_misspelt_flag_is_refused_not_taken_as_another(redis_server, redis_client, queue, capsys):
    """argparse takes any unambiguous prefix of a long flag by default: `submit --n 2` was
    `--no-thinking` (and `2` a stray argument), `--no-think` a chat with thinking off. A flag is
    given whole or it is an error, and nothing is enqueued."""
    for flags in (["--n", "2"], ["--no-think"], ["--max-tok", "4"]):
        try:
            code = main(["--redis", redis_server.url, "--queue", queue, "submit", "x", *flags])
        except SystemExit as e:  # a usage error, from argparse
            code = e.code
        unrecognized = " ".join(flags)
        assert (code, capsys.readouterr().err) == (
            2,
            f"error: invalid_argument: unrecognized arguments: {unrecognized} (see mili --help)\n",
        )
    assert entries_added(redis_client, queue) == 0


@pytest.mark.parametrize(
    "args, unrecognized",
    [
        (["--bogus"], "--bogus"),
        (["-x"], "-x"),
        (["--bogus=3"], "--bogus=3"),
        (["--queue", "q", "--bogus", "--also"], "--bogus --also"),
    ],
)
def test_an_unknown_flag_without_a_command_is_named_exit_2_no_traceback(args, unrecognized):
    """`mili --bogus` said "the following arguments are required: command", not a word of the flag
    it did not know. It says the flag, as argparse says one after a command: one line on stderr,
    exit status 2, nothing on stdout."""
    done = subprocess.run(
        [sys.executable, "-m", "cli", *args], cwd=REPO, capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        2,
        "",
        f"error: invalid_argument: unrecognized arguments: {unrecognized} (see mili --help)\n",
    )
    missing = subprocess.run([sys.executable, "-m", "cli"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (missing.returncode, missing.stderr) == (
        2,
        "error: invalid_argument: the following arguments are required: command (see mili --help)\n",
    )
