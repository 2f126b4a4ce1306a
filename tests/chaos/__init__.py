"""Chaos tests: real redis-server, real worker processes, faults done to them for real (kill -9,
SIGTERM, a Redis restart) or fed to them (bad entries)."""
