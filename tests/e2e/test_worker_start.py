"""How a worker process starts when something is wrong, run for real: a Redis that is not there
yet is waited for (one line, then it serves); wrong credentials and a taken metrics port stop it
at once with one line, before any model loads; no password ever reaches the output. And with no
Redis named at all, on the private one it starts."""

from __future__ import annotations

import gc
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from harness.polling import eventually
from harness.processes import REPO, ChildProcess
from harness.redis_servers import RestartableRedis
from producer_client import Client
from producer_client.keys import Keys
from tests.support.workers import WorkerProcess
from worker.__main__ import GC_YOUNG_THRESHOLD, frozen_startup_objects, serve_metrics
from worker.embedded_redis import EmbeddedRedis, free_port
from worker.metrics import WorkerMetrics
from worker.model.presets import PRESETS, write_random_checkpoint
from worker.model.qwen_tokenizer import write_qwen3_tokenizer_files
from worker.settings import WorkerSettings

SECRET = "s3cret-Pa55"


def worker_command(
    url: str,
    *flags: str,
    model: str = "echo",
    metrics_host: tuple[str, ...] = ("--metrics-host", "127.0.0.1"),
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "worker",
        "serve",
        "--model",
        model,
        "--redis",
        url,
        "--queue",
        "start",
        "--name",
        "start-w",
        *metrics_host,
        "--heartbeat-interval-s",
        "0.1",
        *flags,
    ]


def run_to_exit(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)


def test_a_worker_waits_for_a_redis_that_is_not_there_yet_then_serves(tmp_path):
    server = RestartableRedis(tmp_path)  # its port is chosen; nothing listens on it yet
    worker = WorkerProcess(server.url, "start", "start-w", tmp_path, "--redis-backoff-max-s", "0.2", model="echo")
    try:
        worker.start()
        # Its first try, after its imports (seconds on a loaded machine), then several backoff waits.
        assert eventually(lambda: "does not answer" in worker.log(), 60), worker.log()
        time.sleep(2.0)
        assert worker.running
        server.start()
        with Client(server.url, "start") as client:
            assert client.generate("here", max_tokens=4, timeout=30).text == "here"
        returncode = worker.terminate(timeout=30)
    finally:
        worker.stop()
        server.stop()
    output = worker.log()
    assert returncode == 0, output
    assert "Traceback" not in output
    waiting = [line for line in output.splitlines() if "does not answer" in line]
    assert len(waiting) == 1, output
    assert "answers after" in output


def test_a_worker_left_without_redis_serves_jobs_through_the_private_redis_it_starts(tmp_path):
    """README: start a worker "or leave `--redis` out for a private embedded one". With no --redis
    and no MILI_REDIS, its default `embedded` starts a redis-server of its own, on a unix socket
    only this host reaches, which its log names; a client there gets its jobs served, and the
    server ends with the worker."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MILI_")}
    command = [sys.executable, "-m", "worker", "--model", "echo", "--metrics-port", "0"]
    worker = ChildProcess(command, tmp_path / "worker.log", env=env)
    said = re.compile(r"embedded redis-server at (unix://\S+) \(it stops with this worker\)")
    try:
        worker.start()
        assert eventually(lambda: "serving queue 'default'" in worker.log() or not worker.running, 120), worker.log()
        url = said.search(worker.log())[1]
        with Client(url) as client:
            assert client.generate(prompt="here", max_tokens=4, timeout=60).text == "here"
            assert [w.queue for w in client.workers()] == ["default"]
        returncode = worker.terminate(timeout=60)
    finally:
        worker.stop()
    assert returncode == 0, worker.log()
    assert not Path(url.removeprefix("unix://")).exists()


def test_wrong_credentials_stop_the_worker_at_once_with_one_line_and_no_password(tmp_path):
    with EmbeddedRedis(port=free_port()) as server:
        admin = Client(server.url, "start").redis
        admin.config_set("requirepass", SECRET)
        url = server.url.replace("redis://", f"redis://default:{SECRET}x@")
        done = run_to_exit(worker_command(url, "--metrics-port", "0"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("error: redis_refused: Redis at redis://***@")
    assert "Traceback" not in done.stderr and SECRET not in done.stderr + done.stdout


def test_a_taken_metrics_port_stops_the_worker_before_its_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_to_exit(worker_command("embedded", "--metrics-port", str(port), model="tiny"))
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: metrics_port_taken:") and "--metrics-port" in last
    assert "warming up" not in done.stderr and "Traceback" not in done.stderr


def test_a_metrics_host_that_names_no_address_is_one_line_naming_it_not_a_taken_port():
    unknown = ("--metrics-host", "no.such.host.invalid")
    done = run_to_exit(worker_command("embedded", model="tiny", metrics_host=unknown))
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "error: invalid_argument: metrics_host: 'no.such.host.invalid' is no address this host can listen on: "
    ), last
    assert "another worker" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "cli", "--redis", "{url}", "stats"],
        ["-m", "worker", "healthcheck", "--name", "nobody", "--redis", "{url}"],
    ],
    ids=["mili", "healthcheck"],
)
def test_no_password_reaches_the_output_of_a_failing_command(command):
    url = f"redis://mili:{SECRET}@127.0.0.1:{free_port()}/0"  # nothing listens there
    done = subprocess.run(
        [sys.executable, *(arg.format(url=url) for arg in command)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert SECRET not in done.stderr + done.stdout


def interface_address() -> str | None:
    """An address of this host that is not loopback (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.123", 9))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


def answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


@pytest.mark.parametrize(
    "host_flag, reachable_from_outside",
    [((), False), (("--metrics-host", "0.0.0.0"), True)],
    ids=["default", "every-interface"],
)
def test_a_workers_metrics_listen_where_its_settings_say(host_flag, reachable_from_outside, tmp_path):
    outside = interface_address()
    if outside is None:
        pytest.skip("this host has no address but loopback")
    with EmbeddedRedis(port=free_port()) as server:
        # Not a WorkerProcess, which names a metrics host: the default case must name none.
        worker = ChildProcess(
            worker_command(server.url, "--metrics-port", "0", metrics_host=host_flag), tmp_path / "w.log"
        )
        worker.start()
        try:
            admin = Client(server.url, "start").redis
            heartbeat = Keys().worker("start-w")
            assert eventually(lambda: admin.hget(heartbeat, "metrics_port"), timeout=60)
            port = int(admin.hget(heartbeat, "metrics_port"))
            assert answers("127.0.0.1", port)
            assert answers(outside, port) is reachable_from_outside
            assert metrics_status("127.0.0.1", port, f"127.0.0.1:{port}") == 200
            assert metrics_status("127.0.0.1", port, "evil.example") == 400  # a page rebound by DNS
            if reachable_from_outside:  # Prometheus scrapes a container by its address
                assert metrics_status(outside, port, f"{outside}:{port}") == 200
        finally:
            worker.stop()


def metrics_status(address: str, port: int, host: str) -> int:
    """The status of a raw GET /metrics sent to `address`:`port` with `host` as its Host header."""
    with socket.create_connection((address, port), timeout=10) as conn:
        conn.sendall(f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        head = conn.makefile("rb").readline().decode()
    return int(head.split()[1])


@pytest.mark.parametrize(
    ("allowed_hosts", "host", "status"),
    [
        ([], "evil.example", 400),
        ([], "evil.example:{port}", 400),
        ([], "127.0.0.1:{port}", 200),
        ([], "[::1]:{port}", 200),
        ([], "localhost:{port}", 200),
        ([], "metrics.localhost", 200),
        (["Metrics.Internal"], "metrics.internal:{port}", 200),
        (["metrics.internal"], "evil.example", 400),
        (["*"], "evil.example", 200),
    ],
)
def test_a_workers_metrics_answer_a_host_the_gateways_rule_allows_only(allowed_hosts, host, status):
    """A worker's metrics on loopback were readable by any page rebound by DNS to 127.0.0.1 (its
    requests name its own host): they now answer as an open gateway does (producer_client.hosts),
    with the worker's allowed_hosts (MILI_ALLOWED_HOSTS, as the gateway's). The endpoint the worker
    starts (serve_metrics), asked with raw requests; on main every one was 200."""
    settings = WorkerSettings.load(None, metrics_port=0, allowed_hosts=allowed_hosts)
    server, port = serve_metrics(WorkerMetrics(), settings)
    try:
        assert metrics_status("127.0.0.1", port, host.format(port=port)) == status
    finally:
        server.shutdown()
        server.server_close()


def metrics_answer_to(port: int, head: str) -> tuple[int, bytes]:
    """The status and body of a raw request of `head` (request line and header lines) to a worker's
    metrics."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(head.encode() + b"Connection: close\r\n\r\n")
        answer = conn.makefile("rb").read()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize("allowed_hosts", [[], ["*"]])
def test_a_workers_metrics_answer_an_http_1_1_request_without_one_host_line_400(allowed_hosts):
    """RFC 9112 3.2, as the gateway answers it (gateway/edge.py): an HTTP/1.1 request with no Host
    line, or two, names no one target, and is answered 400 whatever the hosts allowed; HTTP/1.0 had
    no Host to send and is served. On main wsgiref served both (200), and joined two Host lines into
    one value that allowed_hosts "*" let through."""
    settings = WorkerSettings.load(None, metrics_port=0, allowed_hosts=allowed_hosts)
    server, port = serve_metrics(WorkerMetrics(), settings)
    try:
        for head in ("GET /metrics HTTP/1.1\r\n", "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n"):
            status, body = metrics_answer_to(port, head)
            assert (status, body) == (400, b"an HTTP/1.1 request carries exactly one Host header line (RFC 9112 3.2)\n")
        assert metrics_answer_to(port, "GET /metrics HTTP/1.0\r\n")[0] == 200
        assert metrics_answer_to(port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_workers_metrics_close_a_connection_whose_request_stalls_and_serve_on(capfd):
    """wsgiref waited for a request's line and headers without end: each client that opened a
    connection and sent nothing, or half a request, held one of the worker's threads for ever (on
    main the connections below were still open after 20 timeouts). Now each is closed once its
    request stalls request_timeout_s, without a traceback, and a scrape meanwhile is served."""
    timeout_s = 0.5
    server, port = WorkerMetrics().serve("127.0.0.1", 0, request_timeout_s=timeout_s)
    stalled = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
    try:
        stalled[1].sendall(b"GET /metrics HTTP/1.1\r\n")
        stalled[2].sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        assert metrics_answer_to(port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")[0] == 200
        for conn in stalled:
            conn.settimeout(20 * timeout_s)
            assert conn.recv(1024) == b""  # closed by the server, not timed out here (that raises)
    finally:
        for conn in stalled:
            conn.close()
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.cuda
def test_a_worker_with_a_float8_cache_serves_jobs_and_says_what_its_pool_holds(tmp_path):
    """On the device the worker picks: CUDA where there is one (the GPU acceptance's fp8 stage),
    whose pool is sized from its free memory, not kv_cache_mib."""
    cuda = torch.cuda.is_available()
    pool = ("--gpu-memory-utilization", "0.05") if cuda else ("--kv-cache-mib", "64")
    with EmbeddedRedis(port=free_port()) as server:
        # Not a WorkerProcess, which names a KV cache size: on CUDA the pool must come from free memory.
        worker = ChildProcess(
            worker_command(server.url, "--metrics-port", "0", "--kv-cache-dtype", "fp8_e4m3", *pool, model="tiny"),
            tmp_path / "w.log",
        )
        worker.start()
        try:
            with Client(server.url, "start") as client:
                ids = [client.submit(prompt=f"prompt {i} " * 20, max_tokens=8, temperature=0) for i in range(3)]
                results = [client.result(job, timeout=120) for job in ids]
        finally:
            worker.stop()
    output = worker.log()
    assert [(r.status, r.usage.completion_tokens) for r in results] == [("done", 8)] * 3
    # tiny is float32: 4,096 B per token, 1,024 B in float8, so 64 MiB hold 4x the pages.
    pages = (
        r"\d+ pages x 16 tokens = \d+ tokens \([\d.]+ MiB"
        if cuda
        else r"4096 pages x 16 tokens = 65536 tokens \(64\.0 MiB"
    )
    assert re.search(rf"KV cache: {pages}, torch\.float8_e4m3fn, {'cuda' if cuda else 'cpu'}", output), output
    assert "4.0x the tokens of a torch.float32 cache in the same memory" in output


def test_a_model_that_names_nothing_stops_the_worker_at_once_naming_what_model_takes():
    """`--model nope` imported torch and the kernels (seconds), and waited for a Redis not there,
    before it said that nope is no checkpoint directory nor a preset; and it left `echo` unsaid."""
    done = run_to_exit(worker_command(f"redis://127.0.0.1:{free_port()}/0", "--metrics-port", "0", model="nope"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: checkpoint_error: nope: no such checkpoint directory, nor a preset (tiny, tiny-moe, small, "
        "qwen3-0.6b), nor echo (the engine without a model)"
    )
    assert "importing torch" not in done.stderr and "waiting for it" not in done.stderr
    assert "Traceback" not in done.stderr


def test_the_demo_of_a_model_that_names_nothing_stops_at_once_naming_what_model_takes():
    """`demo --model nope` started a redis-server and imported torch (its adapters are the model's)
    before it said that nope is no checkpoint directory nor a preset, as serve did once."""
    code = "import sys; from worker.__main__ import main; code = main(); print('torch' in sys.modules); sys.exit(code)"
    done = run_to_exit([sys.executable, "-c", code, "demo", "--model", "nope"])
    assert (done.returncode, done.stdout) == (2, "False\n"), done.stderr
    assert done.stderr == (
        "error: checkpoint_error: nope: no such checkpoint directory, nor a preset (tiny, tiny-moe, small, "
        "qwen3-0.6b), nor echo (the engine without a model)\n"
    )


def test_a_checkpoint_with_an_unsupported_rope_scaling_stops_the_worker_with_one_line(tmp_path):
    ckpt = write_random_checkpoint(tmp_path / "ckpt", {**PRESETS["tiny"].config, "num_hidden_layers": 1})
    write_qwen3_tokenizer_files(ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}))
    done = run_to_exit(worker_command("embedded", "--metrics-port", "0", model=str(ckpt)))
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: unsupported_model: {ckpt}/config.json: rope_scaling.rope_type 'longrope' is not supported "
        "(only 'default' and 'yarn')"
    )
    assert "Traceback" not in done.stderr


# The steps a worker on a model logs as it starts, in order; each says when it is done, and how long it took.
START_UP_STEPS = [
    r"starting the engine for tiny: importing torch and the kernels \.\.\.",
    r"starting the engine for tiny: importing torch and the kernels: done in \d+\.\d s",
    r"loading \S+/presets/tiny-\w+ on cpu \.\.\.",
    r"loaded \S+/presets/tiny-\w+: 4 layers, 20\.4M parameters, torch\.float32 on cpu",
    r"loading \S+/presets/tiny-\w+ on cpu: done in \d+\.\d s",
    r"warming up: the model and the sampler run once, to compile their kernels \.\.\.",
    r"warming up: the model and the sampler run once, to compile their kernels: done in \d+\.\d s",
    r"started in \d+\.\d s",
    r"serving queue 'start' as start-w \(1024 KV pages\)",
]


def test_a_worker_logs_its_start_up_steps_with_their_times_and_exits_on_sigterm_without_a_leak_dump(tmp_path):
    """gc.freeze kept Triton's objects alive past the interpreter's exit, and its C extension
    (nanobind) printed 27 lines of leaks after the worker's last line, at every exit."""
    with EmbeddedRedis(port=free_port()) as server:
        worker = WorkerProcess(server.url, "start", "start-w", tmp_path)
        try:
            worker.start().wait_ready()
            returncode = worker.terminate(timeout=60)
        finally:
            worker.stop()
    output = worker.log()
    assert returncode == 0, output
    records = [line.split("[start-w] ", 1)[1].split(": ", 1)[1] for line in output.splitlines() if "[start-w] " in line]
    steps = iter(records)
    for step in START_UP_STEPS:
        assert any(re.fullmatch(step, record) for record in steps), f"no {step!r} in order in:\n{output}"
    assert records[-1] == "stopped" and output.endswith("stopped\n"), output
    assert "nanobind" not in output and "leaked" not in output


def test_an_error_ends_the_workers_output_with_no_leak_dump_after_it():
    """The way out of serve_forever after a real error: the error is the process's last line."""
    error = "error: rank_failed: tensor-parallel rank 1 (pid 7) was killed by SIGKILL"
    code = (
        "import triton.language\n"  # Triton's C extension, as a worker on a model has it loaded
        "from worker.__main__ import frozen_startup_objects\n"
        "with frozen_startup_objects():\n"
        f"    raise SystemExit({error!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", error + "\n")


def test_serving_collects_the_young_generation_less_often_and_puts_the_collector_back_after():
    before = gc.get_threshold()
    with frozen_startup_objects():
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *before[1:])
        assert gc.get_freeze_count() > 0
    assert (gc.get_threshold(), gc.get_freeze_count()) == (before, 0)
