"""`mili batch` as users run it (a subprocess of the real CLI) against two echo workers and a real
redis-server: every line answered once, bad lines in the error file with their numbers, and a run
stopped by SIGINT finished by a second run with no job enqueued or run twice."""

import codecs
import json
import resource
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from tqdm import tqdm

from cli.batch_file import AnswerFiles, BatchFileRun, count_lines, read_answers
from harness.polling import eventually
from harness.processes import REPO
from producer_client import Client
from tests.support.jobs import entries_added, runs
from tests.support.workers import echo_workers

pytestmark = pytest.mark.waits

RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def batch_queue():
    return f"batch-cli-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def workers(redis_server, batch_queue, tmp_path_factory):
    """Two echo workers of 8 slots each: a few hundred lines take seconds, time to interrupt."""
    with echo_workers(
        redis_server.url, batch_queue, tmp_path_factory.mktemp("batch-cli-workers"), "--max-running", "8"
    ) as procs:
        yield procs


def request_line(custom_id: str, prompt: str, max_tokens: int, chat: bool = False, **body) -> dict:
    if chat:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "echo",
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                **body,
            },
        }
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "echo", "prompt": prompt, "max_tokens": max_tokens, **body},
    }


def write_lines(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def mili_batch(redis_url: str, queue: str, *args: str, file_bytes: int | None = None) -> subprocess.Popen:
    """`file_bytes`: the largest file the run may write (RLIMIT_FSIZE; Python ignores SIGXFSZ, so a
    write past it fails with EFBIG, as one on a full disk fails with ENOSPC)."""
    limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))) if file_bytes else None
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "--redis", redis_url, "--queue", queue, "batch", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
    )


def finish(process: subprocess.Popen) -> tuple[int, str]:
    _, err = process.communicate(timeout=RUN_TIMEOUT_S)
    return process.returncode, err


def answers_by_id(path: Path) -> dict[str, dict]:
    answers = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {a["custom_id"]: a for a in answers}
    assert len(by_id) == len(answers), "a custom_id answered twice"
    return by_id


def test_every_line_is_answered_once_and_bad_lines_name_their_numbers(redis_server, batch_queue, workers, tmp_path):
    lines = [
        request_line("plain", "hello batch", 64),
        request_line("chat", "hi", 64, chat=True),
        request_line("two", "n=2", 64, n=2, seed=3),
        "{not json",
        request_line("plain", "again", 8),  # a custom_id seen before
        {"custom_id": "embed", "method": "POST", "url": "/v1/embeddings", "body": {"model": "echo"}},
        {"custom_id": "get", "method": "GET", "url": "/v1/completions", "body": {}},
        {"method": "POST", "url": "/v1/completions", "body": {}},
        request_line("cold", "x", 8, temperature=-1),
        request_line("streamed", "x", 8, stream=True),
        "",
        request_line("long", "y" * 40, 40),
        request_line("get", "x", 8),  # the custom_id of a line that is no request (line 8)
    ]
    source = write_lines(tmp_path / "in.jsonl", lines)
    output = tmp_path / "out.jsonl"
    code, err = finish(mili_batch(redis_server.url, batch_queue, str(source), "-o", str(output)))
    assert code == 0, err
    assert "12 of 12 lines answered" in err
    done = answers_by_id(output)
    assert set(done) == {"plain", "chat", "two", "long"}
    assert done["plain"]["response"]["status_code"] == 200
    assert done["plain"]["response"]["body"]["choices"][0]["text"] == "hello batch"
    assert done["chat"]["response"]["body"]["choices"][0]["message"]["content"] == "user: hi\nassistant: "
    assert [c["index"] for c in done["two"]["response"]["body"]["choices"]] == [0, 1]
    assert done["long"]["response"]["body"]["usage"]["completion_tokens"] == 40

    failed = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    by_line = {a["error"]["line"]: a["error"]["code"] for a in failed if a["error"]}
    assert by_line == {
        4: "invalid_json",
        5: "duplicate_custom_id",
        6: "invalid_url",
        7: "invalid_line",
        8: "invalid_line",
        13: "duplicate_custom_id",
    }
    refused = {a["custom_id"]: a["response"] for a in failed if a["response"]}
    assert {k: (r["status_code"], r["body"]["error"]["param"]) for k, r in refused.items()} == {
        "cold": (400, "temperature"),
        "streamed": (400, "stream"),
    }


def test_an_input_that_begins_with_a_byte_order_mark_runs_every_line(redis_server, batch_queue, workers, tmp_path):
    """Notepad, PowerShell and Excel save UTF-8 with a byte order mark: line 1 was answered
    invalid_json. It is no part of the file's lines."""
    plain = write_lines(tmp_path / "plain.jsonl", [request_line("m0", "marked", 8), request_line("m1", "too", 8)])
    source = tmp_path / "bom.jsonl"
    source.write_bytes(codecs.BOM_UTF8 + plain.read_bytes())
    output = tmp_path / "out.jsonl"
    code, err = finish(mili_batch(redis_server.url, batch_queue, str(source), "-o", str(output)))
    assert code == 0, err
    assert "2 of 2 lines answered" in err
    done = answers_by_id(output)
    assert {k: a["response"]["body"]["choices"][0]["text"] for k, a in done.items()} == {"m0": "marked", "m1": "too"}
    assert not (tmp_path / "out.errors.jsonl").exists() or not (tmp_path / "out.errors.jsonl").read_text()


def test_an_interrupted_run_is_finished_by_a_rerun_with_no_job_enqueued_or_run_twice(
    redis_server, redis_client, batch_queue, workers, tmp_path
):
    n = 300
    source = write_lines(tmp_path / "in.jsonl", [request_line(f"r{i}", f"line {i:04d} " * 12, 120) for i in range(n)])
    output, errors = tmp_path / "out.jsonl", tmp_path / "failed.jsonl"
    before = entries_added(redis_client, batch_queue)

    first = mili_batch(
        redis_server.url, batch_queue, str(source), "-o", str(output), "-e", str(errors), "--in-flight", "64"
    )
    assert eventually(lambda: output.exists() and len(output.read_text().splitlines()) >= 30, timeout=RUN_TIMEOUT_S)
    first.send_signal(signal.SIGINT)
    code, err = finish(first)
    assert code == 130, err
    assert "interrupted" in err
    cut_short = answers_by_id(output)
    assert 30 <= len(cut_short) < n

    code, err = finish(mili_batch(redis_server.url, batch_queue, str(source), "-o", str(output), "-e", str(errors)))
    assert code == 0, err
    done = answers_by_id(output)
    assert set(done) == {f"r{i}" for i in range(n)}
    assert all(done[f"r{i}"]["response"]["body"]["choices"][0]["text"] == f"line {i:04d} " * 12 for i in range(n))
    assert errors.read_text() == ""
    # Every line's job was enqueued once and ran once, across both runs.
    job_ids = [a["response"]["request_id"] + "-0" for a in done.values()]
    assert entries_added(redis_client, batch_queue) - before == n
    assert all(len(runs(redis_client, job_id)) == 1 for job_id in job_ids)


def test_a_rerun_cuts_a_line_a_crash_left_half_written_and_answers_it_again(
    redis_server, redis_client, batch_queue, workers, tmp_path
):
    source = write_lines(tmp_path / "in.jsonl", [request_line(f"c{i}", f"crash {i}", 16) for i in range(20)])
    output = tmp_path / "out.jsonl"
    code, err = finish(mili_batch(redis_server.url, batch_queue, str(source), "-o", str(output)))
    assert code == 0, err
    whole = output.read_text()
    added = entries_added(redis_client, batch_queue)
    output.write_text(whole[: len(whole) - len(whole.splitlines()[-1]) // 2 - 1])  # the last line cut in half
    assert len(read_answers(output)) == 19
    code, err = finish(mili_batch(redis_server.url, batch_queue, str(source), "-o", str(output)))
    assert code == 0, err
    assert len(answers_by_id(output)) == 20
    assert entries_added(redis_client, batch_queue) == added  # read back, not run again


def test_an_answer_file_that_cannot_be_written_is_a_one_line_error_and_a_rerun_finishes(
    redis_server, redis_client, batch_queue, workers, tmp_path
):
    """A write of the answers that fails (a full disk: here a file size limit) ended the run with a
    Python traceback of the OSError; it is the CLI's one-line error naming the file, exit 1, and
    the same command run again, with room, answers the lines left once."""
    n = 40
    source = write_lines(tmp_path / "in.jsonl", [request_line(f"w{i}", f"write {i:02d} " * 8, 32) for i in range(n)])
    output = tmp_path / "out.jsonl"
    before = entries_added(redis_client, batch_queue)
    code, err = finish(mili_batch(redis_server.url, batch_queue, str(source), "-o", str(output), file_bytes=4096))
    assert code == 1, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == f"error: invalid_argument: output: {output}: File too large"
    assert 0 < len(read_answers(output)) < n

    code, err = finish(mili_batch(redis_server.url, batch_queue, str(source), "-o", str(output)))
    assert code == 0, err
    assert set(answers_by_id(output)) == {f"w{i}" for i in range(n)}
    assert entries_added(redis_client, batch_queue) - before == n  # the lines answered before not enqueued again


def test_lines_wait_for_room_in_a_full_queue(redis_server, redis_client, batch_queue, workers, tmp_path):
    """A queue bound far below the lines in flight: the run submits what fits, again and again."""
    n = 60
    source = write_lines(tmp_path / "in.jsonl", [request_line(f"f{i}", f"full {i}", 16) for i in range(n)])
    output, errors = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    before = entries_added(redis_client, batch_queue)
    files = AnswerFiles(output, errors)
    # The bound is the shared stream's, which placement bypasses while the workers have room.
    with Client(redis_server.url, batch_queue, max_queue_depth=5, placement=False) as client, tqdm(disable=True) as bar:
        tally = BatchFileRun(
            client, source, count_lines(source), files, in_flight=50, bar=bar, stop=threading.Event()
        ).run()
    files.close()
    assert (tally.done, tally.failed, tally.interrupted) == (n, 0, False)
    assert set(answers_by_id(output)) == {f"f{i}" for i in range(n)}
    assert entries_added(redis_client, batch_queue) - before == n


def test_lines_holding_raw_line_separators_run_whole_and_a_rerun_reads_their_answers(
    redis_server, batch_queue, workers, tmp_path
):
    # JSON allows U+2028, U+2029 and U+0085 raw in a string; the echo worker puts them in the answers too.
    prompts = {f"sep{i}": f"a{sep}b" for i, sep in enumerate(["\u2028", "\u2029", "\x85"])}
    text = (
        "".join(json.dumps(request_line(cid, p, 16), ensure_ascii=False) + "\n" for cid, p in prompts.items())
        + "not json\n"
    )
    input_path = tmp_path / "separators.jsonl"
    input_path.write_text(text, encoding="utf-8")
    output = tmp_path / "out.jsonl"
    code, err = finish(mili_batch(redis_server.url, batch_queue, str(input_path), "-o", str(output)))
    assert code == 0, err
    answered = {a.custom_id: a for a in read_answers(output)}
    assert {cid: a.response.body["choices"][0]["text"] for cid, a in answered.items()} == prompts
    (bad,) = read_answers(tmp_path / "out.errors.jsonl")
    assert bad.error.line == 4
    code, err = finish(mili_batch(redis_server.url, batch_queue, str(input_path), "-o", str(output)))
    assert code == 0, err
    assert len(read_answers(output)) == 3 and len(read_answers(tmp_path / "out.errors.jsonl")) == 1
