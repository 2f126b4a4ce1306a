"""Log lines users cannot forge: a request path, an id, a field name of a producer's entry, an
error message may hold a newline, a carriage return or a terminal's escape sequence; each record
is written as one line with those escaped, and a traceback's lines are indented, so that no line
of it passes for a record. Unit checks of the formatter, then a gateway and a worker for real."""

from __future__ import annotations

import json
import logging
import re
import socket
import uuid

import pytest

from harness.polling import eventually
from producer_client import Client, JobFailed
from producer_client.keys import PROTOCOL_VERSION, Keys
from producer_client.logs import OneLineFormatter
from tests.support.gateways import GatewayProcess
from tests.support.workers import WorkerProcess

FORGED = "2026-01-01 00:00:00,000 INFO gateway: forged"
HOSTILE = f"a\n{FORGED}\r\x1b[31mred\x1b[0m\u2028{FORGED}\x85end"
RECORD_START = re.compile(r"^\d{4}-\d{2}-\d{2} ")


def record(message: str, *args, exc_info=None) -> logging.LogRecord:
    return logging.LogRecord("t", logging.INFO, __file__, 1, message, args, exc_info)


def assert_unforgeable(text: str) -> None:
    assert "\x1b" not in text and "\r" not in text and "\u2028" not in text and "\x85" not in text
    assert not any(line.startswith(FORGED) for line in text.split("\n"))


def test_a_record_is_one_line_with_its_control_characters_escaped():
    line = OneLineFormatter("%(message)s").format(record("path %s", HOSTILE))
    assert "\n" not in line and line.startswith("path a\\n2026") and "\\x1b[31m" in line and "\\u2028" in line
    assert_unforgeable(line)


def test_a_tracebacks_lines_are_indented_and_escaped():
    try:
        raise ValueError(HOSTILE)
    except ValueError as e:
        text = OneLineFormatter("%(message)s").format(record("failed", exc_info=(type(e), e, e.__traceback__)))
    first, *rest = text.split("\n")
    assert first == "failed" and rest and all(line.startswith("    ") for line in rest)
    assert_unforgeable(text)


def test_the_gateway_logs_a_hostile_path_on_one_line(redis_server, tmp_path):
    gateway = GatewayProcess(redis_server.url, tmp_path).start()
    try:
        path = "/v1/x%0A" + FORGED.replace(" ", "%20") + "%0D%1B[31m"
        with socket.create_connection(("127.0.0.1", gateway.port)) as sock:
            sock.sendall(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{gateway.port}\r\nX-Request-Id: {uuid.uuid4().hex}\r\n\r\n".encode()
            )
            assert sock.recv(65536).startswith(b"HTTP/1.1 404")
        assert eventually(lambda: "GET '/v1/x\\n2026" in gateway.log(), timeout=10), gateway.log()
        assert_unforgeable(gateway.log())
    finally:
        gateway.stop()


def test_the_worker_logs_a_producers_hostile_field_names_on_one_line(redis_server, redis_client, tmp_path):
    queue = f"logs-{uuid.uuid4().hex[:6]}"
    worker = WorkerProcess(redis_server.url, queue, f"{queue}-w", tmp_path, model="echo").start().wait_ready()
    try:
        job_id = f"logs-{uuid.uuid4().hex}"
        body = json.dumps({"prompt": "x", "params": {"max_tokens": 2}})
        redis_client.xadd(Keys().queue(queue), {"id": job_id, "v": str(PROTOCOL_VERSION), "body": body, HOSTILE: "1"})
        assert eventually(lambda: redis_client.exists(Keys().job(job_id)), timeout=30)
        with Client(redis_server.url, queue) as client, pytest.raises(JobFailed):
            client.result(job_id, timeout=30)
        assert eventually(lambda: job_id in worker.log(), timeout=10)
        assert_unforgeable(worker.log())
        assert all(RECORD_START.match(line) or line.startswith("    ") for line in worker.log().splitlines() if line)
    finally:
        worker.stop()
