"""The board's tests: one redis-server, an echo worker, gateways in front of them (one open, one
with API keys) and a headless Chromium (Debian's, driven by Playwright; scripts/bootstrap.sh --dev
installs it), all stopped when this package's tests end. Every page a browser test opens is saved
as a PNG under the run's temporary directory (board-screenshots*/), whose path is printed."""

from __future__ import annotations

import json
import shutil

import pytest
from playwright.sync_api import sync_playwright

from tests.board.support import API_KEY, BRISK_KEEPALIVE_S, ECHO_QUEUE, KEEPALIVE_S, PARKED_QUEUE
from tests.support.gateways import GatewayProcess
from tests.support.poison import echo_worker

CHROMIUM = "/usr/bin/chromium"
# Without the networking switches Chromium stalls on a machine without network access.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--no-first-run",
]


@pytest.fixture(scope="package")
def board_worker(redis_server, tmp_path_factory):
    worker = echo_worker(redis_server.url, ECHO_QUEUE, "board-echo-1", tmp_path_factory.mktemp("board-workers"))
    yield worker
    worker.stop()


def gateway_process(redis_server, tmp_path_factory, *flags: str, keepalive_s: float = KEEPALIVE_S) -> GatewayProcess:
    return GatewayProcess(
        redis_server.url,
        tmp_path_factory.mktemp("board-gateway"),
        "--keepalive-s",
        str(keepalive_s),
        "--models",
        json.dumps({"parked": PARKED_QUEUE}),
        *flags,
    ).start()


@pytest.fixture(scope="package")
def open_gateway(redis_server, board_worker, tmp_path_factory):
    gateway = gateway_process(redis_server, tmp_path_factory)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="package")
def brisk_gateway(redis_server, board_worker, tmp_path_factory):
    """An open gateway that sends a keep-alive after each BRISK_KEEPALIVE_S without text."""
    gateway = gateway_process(redis_server, tmp_path_factory, keepalive_s=BRISK_KEEPALIVE_S)
    yield gateway
    gateway.stop()


@pytest.fixture(scope="package")
def keyed_gateway(redis_server, tmp_path_factory):
    gateway = gateway_process(redis_server, tmp_path_factory, "--api-keys", json.dumps([API_KEY]))
    yield gateway
    gateway.stop()


@pytest.fixture(scope="package")
def browser():
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing: scripts/bootstrap.sh --dev installs Debian's chromium"
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="package")
def screenshots(tmp_path_factory, request):
    directory = tmp_path_factory.mktemp("board-screenshots")
    yield directory
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"board screenshots ({len(list(directory.glob('*.png')))}): {directory}")


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    yield page
    context.close()
