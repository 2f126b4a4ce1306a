"""The tests' own harness, shared by every test package: the workers and gateways a test starts
(built on harness/processes.py, which the benchmarks share), the clients and job readers tests check
with, and the fixtures (fixtures.py, loaded by tests/conftest.py through `pytest_plugins`)."""
