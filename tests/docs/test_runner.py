"""The doc-test runner itself (tests/docs/blocks.py, sessions.py, port_map/), on pages written here:
which blocks it runs and how, what it refuses, and that its failures say where and why."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.docs.blocks import PAGES, Kind, blocks_of
from tests.docs.pages import run_page
from tests.docs.sessions import Desk, Servers
from worker.embedded_redis import free_port


def page(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(textwrap.dedent(text))
    return path


def kinds_and_problems(path: Path) -> list[tuple[int, str]]:
    blocks, problems = blocks_of(path)
    return [(b.line, b.problem() or b.kind.value) for b in blocks] + [(0, p) for p in problems]


def test_the_docs_have_blocks_to_run():
    blocks = [b for p in PAGES for b in blocks_of(p)[0]]
    assert len(blocks) > 20
    assert {Kind.PYTHON, Kind.SHELL, Kind.SERVER, Kind.REDIS} <= {b.kind for b in blocks}


def test_each_block_is_classified_by_its_language_and_commands(tmp_path):
    path = page(
        tmp_path,
        """\
        ```python
        x = 1
        ```
        ```bash
        mili stats
        ```
        ```bash
        CUDA_VISIBLE_DEVICES=0 .venv/bin/python -m worker --model tiny \\
            --redis redis://localhost:6379/0
        ```
        ```sh
        mili-gateway --port 8000   # serves until stopped
        ```
        ```bash
        python -m worker demo
        python -m worker healthcheck --name w1
        ```
        ```redis
        PING
        ```
        ```text
        a -> b
        ```
        """,
    )
    assert kinds_and_problems(path) == [
        (1, "python"),
        (4, "shell"),
        (7, "server"),
        (11, "server"),
        (14, "shell"),
        (18, "redis"),
        (21, "picture"),
    ]
    worker, gateway = blocks_of(path)[0][2:4]
    assert (worker.server(), gateway.server()) == ("worker", "gateway")


def test_what_the_runner_cannot_run_is_a_problem_that_names_the_fix(tmp_path):
    path = page(
        tmp_path,
        """\
        ```
        no language
        ```
        ```toml
        a = 1
        ```
        ```bash
        mili-worker --model tiny &
        mili stats
        ```
        ```bash
        pip install mili
        ```
        ```bash
        scripts/run.sh
        ```
        """,
    )
    assert kinds_and_problems(path) == [
        (1, "its fence names no language: ```python, ```bash, ```redis, or ```text for a picture"),
        (4, "no runner for ```toml: mark it <!-- not-run: REASON --> or label it ```text"),
        (7, "a server never returns: give its command a block of its own, the runner waits until it is ready"),
        (11, "it installs or sets up the machine the tests run on: mark it <!-- not-run: REASON -->"),
        (14, "it installs or sets up the machine the tests run on: mark it <!-- not-run: REASON -->"),
    ]


def test_a_marker_needs_a_reason_and_a_block_right_under_it(tmp_path):
    path = page(
        tmp_path,
        """\
        <!-- not-run: it needs a GPU -->
        ```bash
        nvidia-smi
        ```
        <!-- not-run -->
        ```bash
        docker ps
        ```
        <!-- not-run: a marker over prose -->
        Some prose.

        ```toml
        a = 1
        ```
        <!-- not-run: the last line -->
        """,
    )
    blocks, problems = blocks_of(path)
    assert [(b.line, b.not_run, b.problem()) for b in blocks] == [
        (2, "it needs a GPU", None),
        (6, "", "its not-run marker gives no reason"),
        (12, None, "no runner for ```toml: mark it <!-- not-run: REASON --> or label it ```text"),
    ]
    assert problems == [
        f"{path}:9: a not-run marker must come right before a block",
        f"{path}:15: a not-run marker must come right before a block",
    ]


def test_a_block_in_a_list_loses_its_indent_and_keeps_its_page_lines(tmp_path):
    path = page(tmp_path, "- a step:\n\n  ```python\n  if True:\n      x = 1\n  ```\n- after\n")
    (block,), _ = blocks_of(path)
    assert (block.line, block.first_line, block.source) == (3, 4, "if True:\n    x = 1\n")


@pytest.fixture
def desk(tmp_path):
    # No server listens behind these ports: the blocks here do not reach them, except where a test
    # listens on one itself.
    return Desk(tmp_path, Servers(redis_url="redis://127.0.0.1:1/0", redis_port=free_port(), gateway_port=1))


def test_python_blocks_share_a_namespace_and_a_failure_names_the_page_line(tmp_path, desk):
    path = page(
        tmp_path,
        """\
        ```python
        total = 40
        ```
        ```python
        total += 2
        print("total", total)
        ```
        ```python
        print("before")
        raise ValueError("the page is wrong")
        ```
        ```python
        print("after", total)
        ```
        """,
    )
    ran = run_page(blocks_of(path)[0], desk)
    assert [(r.block.line, r.outcome.ok, r.outcome.output) for r in ran if r.block.line != 8] == [
        (1, True, ""),
        (4, True, "total 42\n"),
        (12, True, "after 42\n"),
    ]
    failed = ran[2].outcome
    assert not failed.ok and failed.output.startswith("before\nTraceback (most recent call last):\n")
    assert f'File "{path}", line 10, in <module>\n    raise ValueError("the page is wrong")\n' in failed.output
    assert failed.output.endswith("ValueError: the page is wrong\n")
    report = failed.report(ran[2].block)
    assert report.startswith(f"{path}:8 (```python): it raised (traceback below)\n--- the block ---\nprint(")


def test_shell_blocks_share_a_shell_and_every_failed_command_is_reported_with_its_line(tmp_path, desk):
    path = page(
        tmp_path,
        """\
        ```bash
        GREETING=hello
        echo "$GREETING" > greeting.txt
        ```
        ```bash
        cat greeting.txt
        false
        ls /no/such/dir | cat
        echo "$GREETING again"
        ```
        """,
    )
    first, second = run_page(blocks_of(path)[0], desk)
    assert first.outcome.ok and (desk.dir / "greeting.txt").read_text() == "hello\n"
    assert not second.outcome.ok
    assert second.outcome.detail == (
        "commands failed (lines of the block):\nline 2: false (exit 1)\nline 3: cat (exit 2)\n"
    )
    assert second.outcome.output.startswith("hello\n") and second.outcome.output.endswith("hello again\n")


def test_a_shell_block_that_exits_fails_and_the_next_block_gets_a_new_shell(tmp_path, desk):
    path = page(tmp_path, "```bash\nexit 3\n```\n```bash\necho still here\n```\n")
    first, second = run_page(blocks_of(path)[0], desk)
    assert (first.outcome.ok, first.outcome.detail) == (False, "it ended the shell")
    assert (second.outcome.ok, second.outcome.output) == (True, "still here\n")


def test_a_documented_address_reaches_the_test_server(tmp_path, desk):
    path = page(
        tmp_path,
        """\
        ```python
        import socket

        with socket.create_connection(("localhost", 6379), timeout=10) as s:
            s.sendall(b"PING")
        ```
        """,
    )
    with socket.create_server(("127.0.0.1", desk.servers.redis_port)) as listener:
        listener.settimeout(30)
        (ran,) = run_page(blocks_of(path)[0], desk)
        connection, _ = listener.accept()
        with connection:
            assert connection.recv(4) == b"PING"
    assert ran.outcome.ok, ran.outcome.output


def test_a_server_binds_a_free_port_in_place_of_the_documented_one_and_runs_without_uvloop(desk):
    bound = desk.scratch / "bound"
    code = (
        "import socket, importlib.util\n"
        "s = socket.socket()\n"
        "s.bind(('0.0.0.0', 8000))\n"
        "print(s.getsockname()[1])\n"
        "try:\n"
        "    import uvloop\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e)\n"
    )
    env = desk.env(bound)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True)
    port, hidden = done.stdout.splitlines()
    assert int(port) != 8000 and bound.read_text() == f"8000 {port}\n"
    assert hidden == "No module named 'uvloop' (hidden by the doc tests' port map)"
