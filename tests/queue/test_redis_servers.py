"""The tests' redis-server processes (harness/redis_servers.py): one whose free port another test's
server took before it bound it is never taken for itself."""

import pytest

from harness.processes import ProcessNotReady
from harness.redis_servers import ServerProcess


def test_a_first_start_on_a_port_another_server_took_moves_to_another(tmp_path):
    with_port = ServerProcess(tmp_path / "squatter").start()
    try:
        server = ServerProcess(tmp_path / "server")
        taken = server.port = with_port.port
        server.start()
        try:
            assert server.port != taken
            with server.client() as c:
                assert c.info("server")["process_id"] == server.process.pid
            with with_port.client() as c:
                assert c.info("server")["process_id"] == with_port.process.pid
        finally:
            server.stop()
    finally:
        with_port.stop()


def test_a_restart_on_a_port_another_server_took_fails_and_is_not_taken_for_ready(tmp_path):
    server = ServerProcess(tmp_path / "server").start()
    server.stop()
    squatter = ServerProcess(tmp_path / "squatter")
    squatter.port = server.port
    squatter.start()
    try:
        with pytest.raises(ProcessNotReady, match="Address already in use"):
            server.start()  # others know its port: it keeps it
    finally:
        server.stop()
        squatter.stop()
