"""The tests' harness, shared by every test package: one class for the processes a test starts
(processes.py) and the workers, gateways and redis-servers built on it, one `eventually` for
what a test waits for (polling.py), the clients and job readers tests check with, and the
fixtures (fixtures.py, loaded by tests/conftest.py through `pytest_plugins`)."""
