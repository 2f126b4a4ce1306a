"""`python -m gateway` (console script `mili-gateway`): serve the HTTP gateway under uvicorn.

mili-gateway --redis redis://host:6379/0 --host 0.0.0.0 --port 8000
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys

import uvicorn

from gateway.app import create_app
from gateway.http_protocol import head_timed_protocol
from gateway.lifecycle import Lifecycle
from gateway.settings import GatewaySettings, add_setting_flags, settings_from_args
from producer_client import InvalidArgument, MiliError, logs
from producer_client.arguments import OneLineParser
from producer_client.hosts import no_address
from producer_client.settings import SETTINGS_ERRORS, settings_error_line

log = logging.getLogger("gateway")
# A stream still open this long after SIGTERM is cut; the stop has already told it to end.
GRACEFUL_SHUTDOWN_S = 10


class PortTaken(MiliError):
    code = "port_taken"


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
        sockets = listening_sockets(settings.host, settings.port)
    except MiliError as e:
        print(f"error: {e.code}: {e.message}", file=sys.stderr)
        return 2
    except SETTINGS_ERRORS as e:
        print(f"error: invalid_argument: {settings_error_line(e)}", file=sys.stderr)
        return 2
    serve(settings, sockets)
    return 0


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """The gateway's sockets, bound here, before uvicorn starts, as asyncio's create_server would
    bind them for uvicorn (every address `host` names, SO_REUSEADDR, an IPv6 socket for IPv6
    alone). What stops the start is said in one line, exit code 2, as the worker says its taken
    metrics port: uvicorn logged the resolver's words alone for a host that names no address
    ('[Errno -2] Name or service not known', no host named), and its `[Errno 98] error while
    attempting to bind` for a taken port, then exited 3, after its start-up."""
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise no_address("host", host, e) from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(addresses):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            bind(sock, address)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def bind(sock: socket.socket, address: tuple) -> None:
    try:
        sock.bind(address)
    except OSError as e:
        where = f"{address[0]}:{address[1]}"
        if e.errno == errno.EADDRINUSE:
            raise PortTaken(
                f"cannot listen on {where} ({e.strerror}): another process holds the port. Stop it, or "
                "give the gateway another --port (MILI_PORT)"
            ) from None
        setting = "port" if e.errno == errno.EACCES else "host"
        raise InvalidArgument(setting, f"cannot listen on {where}: {e.strerror}") from None


def build_parser() -> argparse.ArgumentParser:
    # A usage error in one line; no abbreviated flags: a misspelt one is never taken as another setting.
    parser = OneLineParser(prog="mili-gateway", description="MILI's OpenAI-compatible HTTP gateway")
    add_setting_flags(parser)
    return parser


def serve(settings: GatewaySettings, sockets: list[socket.socket]) -> None:
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
    for sock in sockets:
        log.info("listening on %s", url_of(sock))
    GatewayServer(config, lifecycle).run(sockets=sockets)


def url_of(sock: socket.socket) -> str:
    """http://HOST:PORT of a bound socket, its port as bound (`--port 0` takes a free one)."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if sock.family == socket.AF_INET6 else f"http://{host}:{port}"


if __name__ == "__main__":
    sys.exit(main())
