"""Every fenced code block of README.md and docs/*.md runs as written (tests/docs/blocks.py says how
each kind runs, tests/docs/sessions.py runs them), or is marked `<!-- not-run: REASON -->`, so
that no example can rot unseen.

The set-up the pages state is the module's, shared by every page: a redis-server, one worker on
the `tiny` preset serving the queue `default`, and a gateway, behind the documented addresses
`redis://localhost:6379/0` and `http://localhost:8000/v1` (port_map/sitecustomize.py). A page's
blocks run in order in a fresh clone's view, its virtual environment activated, as a user who
follows the README runs them."""

from __future__ import annotations

import pytest

from tests.docs.blocks import PAGES, ROOT, blocks_of
from tests.docs.pages import RUNNERS, run_page
from tests.docs.sessions import Desk, Servers
from tests.support.gateways import GatewayProcess
from tests.support.workers import WorkerProcess
from worker.embedded_redis import EmbeddedRedis, free_port


def runnable(page) -> bool:
    blocks, _ = blocks_of(page)
    return any(b.problem() is None and b.kind in RUNNERS for b in blocks)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("doc-servers")
    with EmbeddedRedis(port=free_port()) as redis:
        worker = WorkerProcess(redis.url, "default", "doc-tiny", logs)
        gateway = GatewayProcess(redis.url, logs)
        try:
            worker.start()
            gateway.start()
            worker.wait_ready()
            yield Servers(redis_url=redis.url, redis_port=redis.port, gateway_port=gateway.port)
        finally:
            gateway.stop()
            worker.stop()


def test_every_block_is_run_or_marked_with_a_reason():
    problems = []
    for page in PAGES:
        blocks, marker_problems = blocks_of(page)
        problems += marker_problems + [f"{b.where}: {b.problem()}" for b in blocks if b.problem()]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [p for p in PAGES if runnable(p)], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_of_the_page_runs_as_written(page, servers, tmp_path):
    blocks, _ = blocks_of(page)
    ran = run_page([b for b in blocks if b.problem() is None], Desk(tmp_path, servers))
    for r in ran:
        print(f"{r.block.where} {r.block.kind.value}: {'ok' if r.outcome.ok else 'FAILED'} in {r.seconds:.1f}s")
    failures = [r.outcome.report(r.block) for r in ran if not r.outcome.ok]
    assert not failures, f"{len(failures)} of {len(ran)} blocks failed:\n\n" + "\n\n".join(failures)
