"""`python -m worker` (console script `mili-worker`).

python -m worker [serve] --model tiny --redis redis://host:6379/0   run a worker (the default command)
python -m worker demo                                              the end-to-end demo on an embedded Redis
python -m worker healthcheck [--redis URL --name NAME]             exit 0 only if this worker's heartbeat is live
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import NoReturn
from wsgiref.simple_server import WSGIServer

import redis

from producer_client import logs
from producer_client.arguments import OneLineParser
from producer_client.connection import is_fatal, not_redis, redact_url
from producer_client.errors import InvalidArgument, MiliError, RedisRefused, RedisUnavailable
from producer_client.hosts import Hosts, no_address
from producer_client.settings import SETTINGS_ERRORS, settings_error_line
from worker.embedded_redis import EmbeddedRedis
from worker.engine.interface import EngineAPI
from worker.healthcheck import run_healthcheck
from worker.loop.queue import RedisLink, connect, is_transient
from worker.loop.service import Worker
from worker.metrics import WorkerMetrics
from worker.model.names import check_model_named
from worker.model.progress import logged_step
from worker.model.rank_failed import RankFailed
from worker.settings import WorkerSettings, add_setting_flags, settings_from_args
from worker.tensor_parallel import EXIT_RANK_FAILED, rank_group

log = logging.getLogger("worker")
COMMANDS = ("serve", "demo", "healthcheck")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["serve", *argv]
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except MiliError as e:
        print(f"error: {e.code}: {e.message}", file=sys.stderr)
        return 2
    except SETTINGS_ERRORS as e:
        print(f"error: invalid_argument: {settings_error_line(e)}", file=sys.stderr)
        return 2
    except RankFailed as e:  # a BaseException: job-level handlers must not catch it
        print(f"error: {e.code}: {e.message}", file=sys.stderr)
        return EXIT_RANK_FAILED
    except KeyboardInterrupt:  # Ctrl-C before the worker took a job: nothing to hand over
        return 130


def build_parser() -> argparse.ArgumentParser:
    # OneLineParser, the subcommands' too: a usage error in one line, and no abbreviated flags
    # (`--log-lev` is an error, not `--log-level`; a misspelt flag is never taken as another one).
    parser = OneLineParser(prog="python -m worker", description="MILI worker: Qwen3 generation from a Redis queue")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run a worker (the default)")
    add_setting_flags(serve)
    serve.set_defaults(run=lambda args: serve_forever(settings_from_args(args)))
    demo = commands.add_parser("demo", help="start Redis and a worker, run a few jobs through the client, stop")
    demo.add_argument("--model", default="tiny", help="preset or checkpoint directory (default: tiny)")
    demo.set_defaults(run=run_demo)
    check = commands.add_parser("healthcheck", help="exit 0 only if Redis answers and this worker's heartbeat is live")
    add_setting_flags(check)
    check.set_defaults(run=run_healthcheck)
    return parser


def run_demo(args: argparse.Namespace) -> int:
    check_model_named(args.model)  # before the demo starts Redis and imports torch (its adapters)
    from worker.demo import demo  # the demo imports the client only when asked for

    return demo(args.model)


def serve_forever(settings: WorkerSettings) -> int:
    """Bind the metrics port, reach Redis, load the model, serve. What a user can get wrong fails
    first, in one line: a taken metrics port or Redis refusing our credentials stop the worker
    before a model loads; a Redis not (yet) reachable is waited for, with backoff."""
    started = time.monotonic()
    name = settings.name or f"{socket.gethostname()}-{os.getpid()}"
    configure_logging(settings.log_level, name)
    check_model_named(settings.model)
    with ExitStack() as stack:
        metrics = WorkerMetrics()
        server, port = serve_metrics(metrics, settings)
        stack.callback(server.shutdown)
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, port)
        url = settings.redis
        if url == "embedded":
            url = stack.enter_context(EmbeddedRedis()).url
            log.info("embedded redis-server at %s (it stops with this worker)", url)
        client = wait_for_redis(url, settings.redis_backoff_max_s)
        stack.callback(client.close)
        engine, device = load_engine(settings)
        stack.enter_context(rank_group(engine))
        worker = Worker(engine, client, settings, metrics, name, device=device, metrics_port=port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: worker.request_stop())
        stack.enter_context(frozen_startup_objects())
        log.info("started in %.1f s", time.monotonic() - started)
        try:
            worker.serve()
        except redis.RedisError as e:
            if not is_fatal(e):
                raise
            raise RedisRefused(redact_url(url), f"{type(e).__name__}: {e}", "this worker") from None
    log.info("stopped")
    return 0


# Allocations of container objects between two collections of the cyclic collector's young
# generation: about 25 steps' worth at batch 256, three an output (see frozen_startup_objects).
GC_YOUNG_THRESHOLD = 20_000


@contextmanager
def frozen_startup_objects() -> Iterator[None]:
    """What startup built (modules, the model, settings) lives as long as the process: out of the
    cyclic garbage collector's reach (gc.freeze), its full collections, which a busy worker sets
    off every few thousand jobs, no longer scan all of it each time (see bench/RESULTS.md).
    Unfrozen on the way out, whatever ends the worker: a frozen object is never collected, not
    even as the interpreter exits, and Triton's C extension (nanobind) reports each of its
    objects still alive then as a leak, a 27-line dump after the worker's last line.

    And the young generation is collected every GC_YOUNG_THRESHOLD allocations instead of
    Python's 700: a step allocates a few objects per running job (its outputs), freed by reference
    counting, and a young collection about every step found the step's outputs still alive and
    promoted them, which then set off collections of the older generations."""
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


class MetricsPortTaken(MiliError):
    code = "metrics_port_taken"


def serve_metrics(metrics: WorkerMetrics, settings: WorkerSettings) -> tuple[WSGIServer, int]:
    """A host that names no address is said so, not as a taken port (another worker's)."""
    host = settings.metrics_host
    try:
        return metrics.serve(host, settings.metrics_port, Hosts.of(settings.allowed_hosts))
    except socket.gaierror as e:
        raise no_address("metrics_host", host, e) from None
    except OSError as e:
        raise MetricsPortTaken(
            f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port} ({e.strerror}): another worker "
            "on this host? Give each worker its own --metrics-port (MILI_METRICS_PORT), or 0 for any free port"
        ) from None


def wait_for_redis(url: str, backoff_max_s: float):
    """The worker's client, once Redis answers PING. Unreachable or loading: wait and try again,
    with the same backoff as a running worker (one line when it starts waiting, one when Redis
    answers). A cluster client is made again at each try: it reads the topology when it is made."""
    link = RedisLink(backoff_max_s)
    client = None
    while True:
        try:
            if client is None:
                client = connect(url)
            client.ping()
        except redis.RedisError as e:
            if is_fatal(e):
                raise RedisRefused(redact_url(url), f"{type(e).__name__}: {e}", "this worker") from None
            if isinstance(e, redis.exceptions.InvalidResponse):
                raise RedisUnavailable(redact_url(url), not_redis(e)) from None
            if not is_transient(e):
                raise
            if link.up:
                log.warning(
                    "Redis at %s does not answer (%s: %s); waiting for it", redact_url(url), type(e).__name__, e
                )
            link.failed(e, quiet=True)
            link.wait(backoff_max_s)
            continue
        down_s = link.succeeded()
        if down_s is not None:
            log.info("Redis at %s answers after %.1fs", redact_url(url), down_s)
        return client


def check_cuda_device(device: str, count: int) -> None:
    """A CUDA device the host has, in one line: torch failed on another at its first tensor, deep
    in the model's load (an AssertionError on a CPU build: 'Torch not compiled with CUDA enabled')."""
    if not device.startswith("cuda"):
        return
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        seen = {0: "no CUDA device", 1: "1 CUDA device (cuda:0)"}.get(
            count, f"{count} CUDA devices (cuda:0 to {count - 1})"
        )
        raise InvalidArgument("device", f"{device}: torch sees {seen} on this host; use cpu, or auto")


def load_engine(settings: WorkerSettings) -> tuple[EngineAPI, str]:
    """(engine, device) for the configured model; 'echo' is the model-free EchoEngine. The device
    of a tensor-parallel engine lists every rank's: cuda:0,cuda:1."""
    if settings.model == "echo":
        from worker.engine.echo import EchoEngine, EchoScript

        return EchoEngine(settings.engine, EchoScript.from_environment()), "cpu"
    with logged_step(log, f"starting the engine for {settings.model}: importing torch and the kernels"):
        import torch

        from worker.engine.engine import Engine

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if settings.engine.tensor_parallel_size == 1:  # the ranks' own check names every device they need
        check_cuda_device(device, torch.cuda.device_count())
    dtype = None if settings.dtype == "auto" else settings.dtype
    # The engine settings as checked at start (settings_from_args), not checked again:
    # from_pretrained's check looked at a lora_dir a second time.
    engine = Engine.from_settings(settings.model, device, dtype, settings.engine)
    try:
        engine.warm_up()  # before the heartbeat: a worker takes jobs only once its kernels are compiled
    except BaseException:
        engine.close()
        raise
    return engine, ",".join(engine.devices)


def configure_logging(level: str, worker_name: str) -> None:
    logs.configure(level, f"%(asctime)s %(levelname)s [{worker_name}] %(name)s: %(message)s")


def run() -> NoReturn:
    """The process's way in (`python -m worker`, `mili-worker`): main, then an exit that leaves
    the interpreter's teardown out. Once main returns, serving is over: every job handed back or
    ended and said so to Redis, the ranks and the embedded Redis stopped, no thread of ours left.
    The teardown then only frees what the OS frees at once: on a worker of the tiny model it ran
    0.7-1.1 s of CPU (full garbage collections over the ~300,000 objects of torch, Triton and the
    model, then each one's release), 15-20% of such a worker's whole life in a test. Output is
    flushed first, the logging handlers' included."""
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
