"""Worker processes on the tiny preset, shared by the end-to-end tests, which run against each of
Redis's three modes (redis_deployment: one server, a cluster, Sentinel): starting a worker costs
seconds (model load), so two are started once per mode and stopped when its tests are done, or
when this package's are (idle, two tiny workers poll Redis for ~0.9 s of CPU a minute)."""

import pytest

from tests.e2e.support import E2E_QUEUE, ENGINE_FLAGS
from tests.support.workers import WorkerProcess, start_workers


@pytest.fixture(scope="package")
def e2e_workers(redis_deployment, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("workers")
    workers = [
        WorkerProcess(redis_deployment.url, E2E_QUEUE, name, log_dir, *ENGINE_FLAGS) for name in ("e2e-a", "e2e-b")
    ]
    try:
        yield start_workers(workers)
    finally:
        for w in workers:
            w.stop()
