"""The Host names MILI's HTTP endpoints answer (the gateway's, a worker's metrics): DNS rebinding.
A page of evil.example whose name its owner then points at 127.0.0.1 is of the endpoint's origin
for the browser, so it sends any header and reads every answer, no CORS asked; but its requests
name its own host. An endpoint open to anyone who reaches it answers a Host that is an address,
`localhost`, a name under `.localhost`, or one its settings allow (`allowed_hosts`,
MILI_ALLOWED_HOSTS). Imported by those programs only, as producer_client.settings: the one layer
both import."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

from producer_client.errors import InvalidArgument


@dataclass(frozen=True)
class Hosts:
    """The Host names an endpoint answers: every one where `checked` is off (a keyed gateway, or
    `allowed_hosts` holding "*"), else addresses, localhost, names under .localhost (RFC 6761:
    browsers resolve them to loopback themselves, never through DNS) and `names`."""

    names: frozenset[str]
    checked: bool

    @classmethod
    def of(cls, allowed_hosts: list[str], keys_required: bool = False) -> Hosts:
        names = frozenset(name.lower() for name in allowed_hosts)
        return cls(names, checked=not keys_required and "*" not in names)

    def allows(self, header: str | None) -> bool:
        # No browser sends a request without a Host: one without it is no rebound page's.
        if not self.checked or header is None:
            return True
        name = host_name(header)
        return is_address(name) or name == "localhost" or name.endswith(".localhost") or name in self.names


# What a request refused by names_one_host is told, by the gateway and by a worker's metrics.
ONE_HOST_LINE = "an HTTP/1.1 request carries exactly one Host header line (RFC 9112 3.2)"


def names_one_host(host_lines: int, http_version: str) -> bool:
    """RFC 9112 3.2: an HTTP/1.1 request without a Host line, or with several, is answered 400 (the
    server cannot tell which target it names); HTTP/1.0 had no Host to send. `http_version` as
    ASGI says it ("1.1"). Neither server under MILI refuses it: uvicorn's parser passes both on,
    wsgiref joins several lines into one value."""
    return host_lines == 1 or (host_lines == 0 and http_version == "1.0")


def host_name(header: str) -> str:
    """A Host header's name or address, without its port or a final dot: `[::1]:8000` is `::1`,
    `LocalHost.:8000` is `localhost`."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    if header.count(":") == 1:
        header = header.partition(":")[0]
    return header.removesuffix(".")


def is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def no_address(setting: str, host: str, error: socket.gaierror) -> InvalidArgument:
    """The error for a host to listen on that resolves to no address (the gateway's `host`, a
    worker's `metrics_host`): one line naming it and the resolver's words."""
    return InvalidArgument(setting, f"{host!r} is no address this host can listen on: {error.strerror}")
