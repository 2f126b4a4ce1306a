"""Worker processes on the tiny preset, shared by the end-to-end tests: starting one costs
seconds (model load), so two are started once per session and stopped at its end."""
import pytest

from tests.redis_support import WorkerProcess, client_kind, redis_client, redis_server, start_workers  # noqa: F401

E2E_QUEUE = "e2e"
MAX_RUNNING = 2
MAX_MODEL_LEN = 256
# Both workers and the offline reference engine use these engine settings.
ENGINE_FLAGS = ("--max-running", str(MAX_RUNNING), "--max-model-len", str(MAX_MODEL_LEN))


@pytest.fixture(scope="session")
def e2e_workers(redis_server, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("workers")
    workers = [WorkerProcess(redis_server.url, E2E_QUEUE, name, log_dir, *ENGINE_FLAGS) for name in ("e2e-a", "e2e-b")]
    try:
        yield start_workers(workers)
    finally:
        for w in workers:
            w.stop()
