"""`python -m worker` (console script `mili-worker`).

    python -m worker [serve] --model tiny --redis redis://host:6379/0   run a worker (the default command)
    python -m worker demo                                              the end-to-end demo on an embedded Redis
    python -m worker healthcheck [--redis URL --name NAME]             exit 0 only if this worker's heartbeat is live
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from contextlib import ExitStack

from producer_client.errors import MiliError
from worker.embedded_redis import EmbeddedRedis
from worker.healthcheck import run_healthcheck
from worker.metrics import WorkerMetrics
from worker.queue import connect
from worker.service import Worker
from worker.settings import WorkerSettings, add_setting_flags, settings_from_args

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker", description="MILI worker: Qwen3 generation from a Redis queue")
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
    from worker.demo import demo  # the demo imports the client only when asked for

    return demo(args.model)


def serve_forever(settings: WorkerSettings) -> int:
    name = settings.name or f"{socket.gethostname()}-{os.getpid()}"
    configure_logging(settings.log_level, name)
    with ExitStack() as stack:
        url = settings.redis
        if url == "embedded":
            url = stack.enter_context(EmbeddedRedis()).url
            log.info("embedded redis-server at %s (it stops with this worker)", url)
        client = connect(url)
        stack.callback(client.close)
        client.ping()
        engine, device = load_engine(settings)
        metrics = WorkerMetrics()
        server, port = metrics.serve(settings.metrics_host, settings.metrics_port)
        stack.callback(server.shutdown)
        log.info("metrics on http://%s:%d/metrics", settings.metrics_host, port)
        worker = Worker(engine, client, settings, metrics, name, device=device, metrics_port=port)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: worker.request_stop())
        worker.serve()
    log.info("stopped")
    return 0


def load_engine(settings: WorkerSettings):
    """(engine, device) for the configured model; 'echo' is the model-free EchoEngine."""
    if settings.model == "echo":
        from worker.echo_engine import EchoEngine

        return EchoEngine(settings.engine), "cpu"
    import torch

    from worker.engine.engine import Engine

    device = settings.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = None if settings.dtype == "auto" else settings.dtype
    engine = Engine.from_pretrained(settings.model, device=device, dtype=dtype, **settings.engine.model_dump())
    engine.warm_up()  # before the heartbeat: a worker takes jobs only once its kernels are compiled
    return engine, device


def configure_logging(level: str, worker_name: str) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s [{worker_name}] %(name)s: %(message)s",
    )


if __name__ == "__main__":
    sys.exit(main())
