"""`python -m gateway` (console script `mili-gateway`): serve the HTTP gateway under uvicorn.

mili-gateway --redis redis://host:6379/0 --host 0.0.0.0 --port 8000
"""

from __future__ import annotations

import argparse
import socket
import sys

import uvicorn

from gateway.app import create_app
from gateway.http_protocol import head_timed_protocol
from gateway.lifecycle import Lifecycle
from gateway.settings import GatewaySettings, add_setting_flags, settings_from_args
from producer_client import MiliError, logs
from producer_client.arguments import OneLineParser
from producer_client.hosts import no_address
from producer_client.settings import SETTINGS_ERRORS, settings_error_line

# A stream still open this long after SIGTERM is cut; the stop has already told it to end.
GRACEFUL_SHUTDOWN_S = 10


class GatewayServer(uvicorn.Server):
    """uvicorn's server, telling the open requests that the gateway stops before uvicorn waits
    for them to end (see gateway.lifecycle)."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle):
        super().__init__(config)
        self.lifecycle = lifecycle

    def handle_exit(self, sig, frame) -> None:
        self.lifecycle.stop_from_signal()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = settings_from_args(build_parser().parse_args(argv))
        check_host_resolves(settings.host, settings.port)
    except MiliError as e:
        print(f"error: {e.code}: {e.message}", file=sys.stderr)
        return 2
    except SETTINGS_ERRORS as e:
        print(f"error: invalid_argument: {settings_error_line(e)}", file=sys.stderr)
        return 2
    serve(settings)
    return 0


def check_host_resolves(host: str, port: int) -> None:
    """A host that names no address, in one line: uvicorn logged the resolver's words alone
    ('[Errno -2] Name or service not known', no host named) and exited 3, after its start-up."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise no_address("host", host, e) from None


def build_parser() -> argparse.ArgumentParser:
    # A usage error in one line; no abbreviated flags: a misspelt one is never taken as another setting.
    parser = OneLineParser(prog="mili-gateway", description="MILI's OpenAI-compatible HTTP gateway")
    add_setting_flags(parser)
    return parser


def serve(settings: GatewaySettings) -> None:
    logs.configure(settings.log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    lifecycle = Lifecycle()
    # proxy_headers off: create_app believes X-Forwarded-* of `trusted_proxies` only, whatever
    # uvicorn's FORWARDED_ALLOW_IPS says.
    config = uvicorn.Config(
        create_app(settings, lifecycle),
        host=settings.host,
        port=settings.port,
        http=head_timed_protocol(settings.header_timeout_s),
        access_log=False,
        proxy_headers=False,
        log_level=settings.log_level.lower(),
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        log_config=None,  # uvicorn's loggers write through ours (producer_client.logs)
    )
    GatewayServer(config, lifecycle).run()


if __name__ == "__main__":
    sys.exit(main())
