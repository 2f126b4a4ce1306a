"""Chaos tests: real redis-server, real worker processes, faults done to them for real (kill -9,
SIGTERM, a Redis restart) or fed to them (bad entries)."""
from tests.redis_support import (  # noqa: F401  (fixtures)
    deployment_client, redis_client, redis_client_of, redis_cluster, redis_deployment, redis_sentinel, redis_server,
    restartable_redis,
)

# Recovery settings small enough for a test: an entry idle for a second is reclaimed, and workers
# look for one every 0.2 s (WorkerProcess heartbeats every 0.1 s).
FAST_RECLAIM = ("--claim-idle-ms", "1000", "--reclaim-interval-s", "0.2")
