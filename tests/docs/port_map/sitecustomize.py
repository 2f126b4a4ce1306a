"""The documented addresses, in every Python process a doc block starts (tests/docs/sessions.py puts
this directory first on PYTHONPATH, and Python imports `sitecustomize` at start-up): the pages say
`redis://localhost:6379/0` and `http://localhost:8000/v1`, and the test's servers listen on free
ports, so a connection to a documented loopback port goes to the test's server instead, the block's
text unchanged. A server a block starts binds a free port in place of the documented one (a test's
8000 or 9400 may be taken), and the port it got is written to a file for the test to probe.

MILI_DOC_PORT_MAP: {"connect": {"6379": PORT, ...}, "bound": FILE or null}.

uvloop is hidden from these processes: its event loop resolves and connects in C (libuv), past
these patches, and the gateway's uvicorn takes it when it is installed. Without it uvicorn runs on
asyncio's loop, whose connections are Python sockets."""

from __future__ import annotations

import importlib.abc
import json
import os
import socket
import sys

LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "0.0.0.0", "::", ""})


def install(spec: dict) -> None:
    ports = {int(port): int(to) for port, to in spec.get("connect", {}).items()}
    bound = spec.get("bound")
    original_getaddrinfo = socket.getaddrinfo
    original_connect = socket.socket.connect
    original_connect_ex = socket.socket.connect_ex
    original_bind = socket.socket.bind

    def mapped(address):
        if isinstance(address, tuple) and address[0] in LOOPBACK and address[1] in ports:
            return (
                ("127.0.0.1", ports[address[1]])
                if len(address) == 2
                else address[:1] + (ports[address[1]],) + address[2:]
            )
        return address

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        # A passive lookup names an address to bind (the gateway resolves its --host and --port
        # itself): bind() below maps it, so the test learns the documented port it stands for.
        if not flags & socket.AI_PASSIVE and host in LOOPBACK and port is not None and int(port) in ports:
            host, port = "127.0.0.1", ports[int(port)]
        return original_getaddrinfo(host, port, family, type, proto, flags)

    def connect(self, address):
        return original_connect(self, mapped(address))

    def connect_ex(self, address):
        return original_connect_ex(self, mapped(address))

    def bind(self, address):
        if bound is None or not isinstance(address, tuple) or not address[1]:
            return original_bind(self, address)
        original_bind(self, (address[0], 0, *address[2:]))
        with open(bound, "a") as record:
            record.write(f"{address[1]} {self.getsockname()[1]}\n")

    socket.getaddrinfo = getaddrinfo
    socket.socket.connect = connect
    socket.socket.connect_ex = connect_ex
    socket.socket.bind = bind


class WithoutUvloop(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == "uvloop":
            raise ModuleNotFoundError(f"No module named {name!r} (hidden by the doc tests' port map)", name=name)


if "MILI_DOC_PORT_MAP" in os.environ:
    install(json.loads(os.environ["MILI_DOC_PORT_MAP"]))
    sys.meta_path.insert(0, WithoutUvloop())
