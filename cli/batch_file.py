"""`mili batch INPUT.jsonl -o OUTPUT.jsonl [-e ERRORS.jsonl]`: an OpenAI batch file run through
the queue, every worker attached to it sharing the work.

Resumable. Each line's jobs get request ids derived from the input file's path, the line's
custom_id and its body (LineRequest.request_id), so running the same command again after a crash
or Ctrl-C enqueues no job twice: jobs still queued or running are found, not added again, and
those that ended are read back from Redis (their results stay there for the workers'
result_ttl_s). The output and error files are append-only, and what they hold is done: a rerun
answers only the lines they lack (a line cut short by a crash is cut off first), so they end
complete and without duplicates.

Answers come in the order their jobs end, as OpenAI's do: match them by custom_id. The line
format (openai_format.batch_lines) is the gateway's too, validated and rendered by the code its
routes use, with no web framework: the plain install runs this command.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from pydantic import ValidationError
from tqdm import tqdm

from openai_format.batch_flight import REFUSALS, Flight
from openai_format.batch_lines import (
    LineError,
    LineJobs,
    OutputLine,
    answer,
    error_answer,
    jsonl_lines,
    line_request,
    not_a_request,
    noted_line,
    request_id,
)
from openai_format.errors import APIError
from producer_client.client import Client
from producer_client.errors import InvalidArgument

log = logging.getLogger("mili.batch")

READ_WAIT_S = 0.5  # the longest wait for results before the run looks at the queue again


def default_errors_path(output: Path) -> Path:
    """OUTPUT with `.errors.jsonl` in place of `.jsonl` (appended to any other name)."""
    return output.with_name(output.name.removesuffix(".jsonl") + ".errors.jsonl")


@dataclass
class Tally:
    """What the run has answered, for the progress bar and the summary."""

    lines: int  # the input's lines, blank ones left out
    done_before: int = 0  # answered by an earlier run
    done: int = 0
    failed: int = 0
    completion_tokens: int = 0
    interrupted: bool = False
    started: float = field(default_factory=time.monotonic)

    def tokens_per_s(self) -> float:
        return self.completion_tokens / max(time.monotonic() - self.started, 1e-9)


class AnswerFiles:
    """The output and error files. A line is answered once: by a custom_id (a request's answer)
    or, for a line that is not a request, by its line number."""

    def __init__(self, output: Path, errors: Path):
        self.paths = {"output": output, "errors": errors}
        with file_argument("output", output):
            written = read_answers(output)
        with file_argument("errors", errors):
            written += read_answers(errors)
        self.custom_ids = {a.custom_id for a in written if a.error is None or a.error.line is None}
        self.lines = {a.error.line for a in written if a.error is not None and a.error.line is not None}
        with file_argument("output", output):
            self.output: TextIO = output.open("a", encoding="utf-8")
        with file_argument("errors", errors):
            self.errors: TextIO = errors.open("a", encoding="utf-8")

    def answered(self, custom_id: str) -> bool:
        return custom_id in self.custom_ids

    def write(self, line: OutputLine) -> None:
        name, file = ("output", self.output) if line.ok else ("errors", self.errors)
        with file_argument(name, self.paths[name]):  # a full disk: the CLI's one-line error, not a traceback
            file.write(line.model_dump_json() + "\n")

    def flush(self) -> None:
        for name, file in (("output", self.output), ("errors", self.errors)):
            with file_argument(name, self.paths[name]):
                file.flush()

    def close(self) -> None:
        for name, file in (("output", self.output), ("errors", self.errors)):
            with file_argument(name, self.paths[name]):
                file.close()


@contextmanager
def file_argument(name: str, path: Path) -> Iterator[None]:
    """An OSError on `path`, the file the argument `name` names (missing, a directory, not
    allowed), as InvalidArgument: the CLI's one-line error, not a traceback."""
    try:
        yield
    except OSError as e:
        raise InvalidArgument(name, f"{path}: {e.strerror or e}") from None


def read_answers(path: Path) -> list[OutputLine]:
    """The answers a file holds. A last line without its newline was cut short by a crash: it is
    cut off the file, and its line is answered again."""
    if not path.exists():
        return []
    data = path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]
    if len(whole) < len(data):
        with path.open("r+b") as f:
            f.truncate(len(whole))
    answers = []
    for number, text in enumerate(jsonl_lines(whole.decode("utf-8")), 1):
        if not text:
            continue
        try:
            answers.append(OutputLine.model_validate_json(text))
        except ValidationError:
            raise InvalidArgument(
                "output", f"line {number} of {path} is not an answer of a batch: not this run's file?"
            ) from None
    return answers


class BatchFileRun:
    """Submits the input's request lines, at most `in_flight` jobs ahead of their answers (a
    line's jobs count until its answer), and writes each line's answer once all its jobs have
    ended."""

    def __init__(
        self,
        client: Client,
        input_path: Path,
        lines: int,
        files: AnswerFiles,
        in_flight: int,
        bar: tqdm,
        stop: threading.Event,
    ):
        self.client = client
        self.stop = stop
        self.input_path = input_path
        self.scope = str(input_path.resolve())
        self.files = files
        self.bar = bar
        self.tally = Tally(lines=lines)
        self.flight = Flight(client.keys, in_flight, weight=lambda line: len(line.request.specs))

    def run(self) -> Tally:
        todo = self.lines_to_run()
        exhausted = False
        while not self.stop.is_set():
            exhausted = self.fill(todo) or exhausted
            if exhausted and self.flight.idle:
                return self.tally
            self.collect()
        self.tally.interrupted = True
        return self.tally

    def lines_to_run(self) -> Iterator[LineJobs]:
        """The input's request lines not answered yet. The others are answered here and now: a
        line that is not a request, a second line with a custom_id, a bad body."""
        seen: set[str] = set()
        # JSON Lines end at \n only (jsonl_lines); utf-8-sig: a byte order mark is no part of line 1 (without_bom).
        with self.input_path.open(encoding="utf-8-sig", newline="\n") as f:
            for number, text in enumerate(f, 1):
                if not text.strip():
                    continue
                try:
                    line = noted_line(text, number, seen)
                except LineError as e:
                    self.answer_once_by_line(e)
                    continue
                if self.files.answered(line.custom_id):
                    self.tally.done_before += 1
                    continue
                try:
                    request = line_request(line, number)
                except APIError as e:
                    rid = request_id(self.scope, line.custom_id, line.body, self.client.tenant)
                    self.write(error_answer(line.custom_id, rid, e))
                    continue
                yield LineJobs(request, request.request_id(self.scope, self.client.tenant))

    def answer_once_by_line(self, error: LineError) -> None:
        if error.line in self.files.lines:
            self.tally.done_before += 1
        else:
            self.write(not_a_request(error, self.scope))

    def fill(self, todo: Iterator[LineJobs]) -> bool:
        """Add lines while the flight has room, and submit those due; True once the input is spent."""
        exhausted = False
        while self.flight.room() > 0:
            line = next(todo, None)
            if line is None:
                exhausted = True
                break
            self.flight.add(line)
        for lines in self.flight.due().values():
            self.submit(lines)
        return exhausted

    def submit(self, lines: list[LineJobs]) -> None:
        try:
            self.client.submit_many([spec for line in lines for spec in line.submit_specs()])
        except REFUSALS as full:
            waiting = self.flight.submitted(lines, full)
            log.info("%s: %d lines wait", full, len(waiting))
        else:
            self.flight.submitted(lines)

    def collect(self) -> None:
        if not self.flight.watch:
            time.sleep(max(0.0, min(READ_WAIT_S, self.flight.retry_at - time.monotonic())))
            return
        for line in self.flight.ended(self.client.finished(self.flight.watch, timeout=READ_WAIT_S)):
            self.write(answer(line.request, line.request_id, line.in_choice_order()))
        self.files.flush()

    def write(self, line: OutputLine) -> None:
        self.files.write(line)
        self.tally.done += line.ok
        self.tally.failed += not line.ok
        self.tally.completion_tokens += line.completion_tokens()
        self.bar.update(1)
        self.bar.set_postfix(
            done=self.tally.done, failed=self.tally.failed, tok_s=f"{self.tally.tokens_per_s():.0f}", refresh=False
        )


def count_lines(path: Path) -> int:
    """The input's request lines (blank ones left out), once sure that the whole file reads as
    UTF-8 and holds one: one that does not is refused before any of its lines is submitted, as the
    Batch API refuses such an upload, and a batch of such a file (`empty_file`)."""
    count = 0
    with file_argument("input", path), path.open("rb") as f:
        for number, raw in enumerate(f, 1):  # split at b"\n" only, as jsonl_lines splits
            try:
                count += bool(raw.decode("utf-8-sig" if number == 1 else "utf-8").strip())
            except UnicodeDecodeError as e:
                raise InvalidArgument(
                    "input", f"{path}: line {number} is not UTF-8 text ({e.reason} at byte {e.start})"
                ) from None
    if not count:
        raise InvalidArgument("input", f"{path}: holds no request: it is empty or its lines are all blank")
    return count


def run_batch(
    client: Client, input_path: Path, output: Path, errors: Path, in_flight: int, stop: threading.Event
) -> Tally:
    """Answer every line of `input_path` not answered yet in `output` and `errors`. Setting `stop`
    (Ctrl-C) ends the run within READ_WAIT_S, between two exchanges with Redis, so that nothing is
    left half-sent: the answers written so far stay, and the jobs in flight run on. Run it again to
    finish."""
    lines = count_lines(input_path)  # before the output is created: a wrong input leaves no file
    files = AnswerFiles(output, errors)
    bar = tqdm(unit="line", dynamic_ncols=True)
    run = BatchFileRun(client, input_path, lines, files, in_flight, bar, stop)
    bar.total = run.tally.lines - len(files.custom_ids) - len(files.lines)
    try:
        return run.run()
    finally:
        bar.close()  # first: one left open draws itself again at exit, after the error line of a failed write
        files.flush()
        files.close()
