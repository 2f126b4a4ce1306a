"""docs/operations.md says what the code does: its settings table is the settings model, its
metrics table is what a worker exports, its sizing example is the KV pool's arithmetic, its (and
docs/failure-semantics.md's) clients' retries are the retry policy's; and every file the README and
docs/ name exists."""

from __future__ import annotations

import argparse
import re

import pytest
import torch

from gateway.metrics import QueueBacklogs
from kernels.fp8 import FP8_DTYPE
from producer_client.connection import RETRIES, RETRY_BASE_S, RETRY_CAP_S, Mode
from producer_client.protocol.replication import REDIS_PY_SOCKET_TIMEOUT_S
from producer_client.schema import QueueStats, StreamStats
from tests.deploy.support import DOCKER, ROOT, load_compose, redis_server_flags
from worker.engine.kv_pool import KVCacheShape
from worker.engine.settings import EngineSettings
from worker.model.presets import PRESETS
from worker.settings import WorkerSettings, add_setting_flags

DOC = (ROOT / "docs" / "operations.md").read_text()
ALL_DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def table_rows(heading: str) -> list[list[str]]:
    """The cells of the first table under `## heading`, header and rule left out."""
    section = re.split(rf"^## {re.escape(heading)}\n", DOC, maxsplit=1, flags=re.M)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def code(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def rendered_default(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def all_settings() -> dict[str, tuple[str, object]]:
    """{table name: (flag name, default)} for every setting, engine settings as engine.<name>."""
    settings = {name: (name, f.default) for name, f in WorkerSettings.model_fields.items() if name != "engine"}
    settings |= {f"engine.{name}": (name, f.default) for name, f in EngineSettings.model_fields.items()}
    return settings


def test_the_settings_table_has_a_row_for_every_setting_with_its_default():
    rows = {code(row[0])[0]: row for row in table_rows("Settings")}
    assert set(rows) == set(all_settings())
    parser = argparse.ArgumentParser()
    add_setting_flags(parser)
    known_flags = {option for action in parser._actions for option in action.option_strings}
    for name, (flag_name, default) in all_settings().items():
        setting, env, flags, shown_default, meaning = rows[name]
        assert code(env) == [f"MILI_{name.upper().replace('.', '__')}"], name
        assert code(flags)[0] == "--" + flag_name.replace("_", "-") and set(code(flags)) <= known_flags, name
        assert shown_default == rendered_default(default), name
        assert meaning, name


def test_the_metrics_table_lists_exactly_what_a_worker_exports(scraped_families):
    documented = {}
    for name_cell, kind, _ in table_rows("Metrics"):
        documented[re.sub(r"\{.*\}", "", code(name_cell)[0])] = kind
    exported = {}
    for family, (kind, _) in scraped_families.items():
        # prometheus_client exposes each counter's and histogram's creation time as a gauge
        # family of its own, <family>_created: bookkeeping, not a metric to document.
        bookkeeping = family.endswith("_created") and family.removesuffix("_created") in scraped_families
        if family.startswith("mili_") and not bookkeeping:
            exported[f"{family}_total" if kind == "counter" else family] = kind
    assert documented == exported


def test_the_backlog_metrics_table_lists_exactly_what_the_gateway_exports_of_the_queues():
    backlogs = QueueBacklogs()
    flex = StreamStats(lane="flex", tenant="t", depth=1, pending=0, waiting=1)
    backlogs.stats = [QueueStats(queue="q", depth=1, pending=0, waiting=1, workers=[], streams=[flex])]
    exported = {(f.name, frozenset(f.samples[0].labels)): f.type for f in backlogs.collect()}
    documented = {}
    for name_cell, kind, _ in table_rows("Backlog metrics"):
        name, labels = re.fullmatch(r"(\w+)(?:\{([\w,]+)\})?", code(name_cell)[0]).groups()
        documented[(name, frozenset(labels.split(",") if labels else ()))] = kind
    assert documented == exported


def test_the_sizing_example_is_the_kv_pools_arithmetic():
    shape = PRESETS["qwen3-0.6b"].config
    kv = KVCacheShape(
        shape["num_hidden_layers"],
        shape["num_key_value_heads"],
        shape["head_dim"],
        16,
        PRESETS["qwen3-0.6b"].dtype,
    )
    per_token = kv.bytes_per_page // 16
    assert f"{per_token:,} B per token" in DOC and f"{kv.bytes_per_page:,} B (1.75 MiB)" in DOC
    pages = int(77 * 2**30 * EngineSettings().gpu_memory_utilization) // kv.bytes_per_page
    assert f"{pages:,} pages, which is {pages * 16:,} tokens" in DOC
    tiny = PRESETS["tiny"].config
    tiny_kv = KVCacheShape(tiny["num_hidden_layers"], tiny["num_key_value_heads"], tiny["head_dim"], 16, torch.float32)
    assert f"{tiny_kv.bytes_per_page // 16:,} B per token" in DOC
    cpu_pages = EngineSettings().kv_cache_mib * 2**20 // tiny_kv.bytes_per_page
    assert f"{cpu_pages:,} pages of 16 tokens" in DOC


def test_the_fp8_sizing_example_is_the_kv_pools_arithmetic():
    shape = PRESETS["qwen3-0.6b"].config
    kv = KVCacheShape(shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"], 16, FP8_DTYPE)
    pages = int(77 * 2**30 * EngineSettings().gpu_memory_utilization) // kv.bytes_per_page
    assert (
        f"{kv.bytes_per_page // 16:,} B per token; the 80 GB example above gets {pages:,} pages,\n  which is "
        f"{pages * 16:,} tokens" in DOC
    )


def test_the_redis_command_matches_the_compose_redis():
    command = re.search(r"^redis-server (.*) --daemonize yes$", DOC, flags=re.M).group(1)
    compose_redis = load_compose(DOCKER / "compose.yml")["services"]["redis"]["command"]
    assert redis_server_flags(["redis-server", *command.split()]) == redis_server_flags(compose_redis)


@pytest.mark.parametrize(
    "path", sorted({p.rstrip("/") for p in re.findall(r"`((?:docker|config|docs)/[^`\s]*|\.dockerignore)`", ALL_DOCS)})
)
def test_every_file_it_names_exists(path):
    assert (ROOT / path).exists()


def mean_retry_wait_s(mode: Mode) -> float:
    """The mean of the waits between a call's tries in `mode`: redis-py's ExponentialWithJitterBackoff
    waits min(cap, U * base * 2**f) after failure f (U uniform in [0, 1)), RETRIES[mode] times."""
    total = 0.0
    for failure in range(1, RETRIES[mode] + 1):
        top = RETRY_BASE_S * 2**failure
        total += top / 2 if top <= RETRY_CAP_S else RETRY_CAP_S - RETRY_CAP_S**2 / (2 * top)
    return total


def test_the_clients_retries_are_said_as_the_retry_policy_spends_them():
    """failure-semantics.md's retry counts and times, and the redis_unavailable row's, are the policy's
    (they said 10 tries over about 4 s and 40 over about 20 s, where a call spends 1 + 10 tries over
    about 6 s, measured 5.8 to 6.6 s against a refusing port, and 1 + 40 over about 36 s)."""
    text = " ".join((ROOT / "docs" / "failure-semantics.md").read_text().split())
    server, distributed = mean_retry_wait_s(Mode.SERVER), mean_retry_wait_s(Mode.SENTINEL)
    assert mean_retry_wait_s(Mode.CLUSTER) == distributed
    said = re.search(r"(\d+) retries \((\d+) tries\) with exponential backoff and jitter, about (\d+) s in all", text)
    assert said and [int(n) for n in said.groups()] == [RETRIES[Mode.SERVER], RETRIES[Mode.SERVER] + 1, round(server)]
    said = re.search(r"failover, (\d+) retries, about (\d+) s", text)
    assert said and [int(n) for n in said.groups()] == [RETRIES[Mode.SENTINEL], round(distributed)]
    said = re.search(r"about (\d+) s on one server, (\d+) s under Sentinel or on a cluster", text)
    assert said and [int(n) for n in said.groups()] == [round(server), round(distributed)]
    said = re.search(r"the clients retry each call for about (\d+) s", " ".join(DOC.split()))
    assert said and int(said[1]) == round(distributed)


def test_what_a_redis_that_never_answers_costs_a_call_is_said():
    """The retries' 6 s are the waits between tries: against a Redis that takes the connection and
    never answers, each of the 11 tries also waits out the socket's timeout, and a call raised
    RedisTimedOut after 60.6 s (measured: Client.status on a port that accepts and stays silent),
    where failure-semantics.md said 'about 6 s on one server' alone."""
    text = " ".join((ROOT / "docs" / "failure-semantics.md").read_text().split())
    tries = RETRIES[Mode.SERVER] + 1
    said = re.search(
        r"raises `RedisTimedOut` after about (\d+) s on one server \((\d+) tries of (\d+) s and the waits\)", text
    )
    assert said, "failure-semantics.md says not what a silent Redis costs a call"
    total = tries * REDIS_PY_SOCKET_TIMEOUT_S + mean_retry_wait_s(Mode.SERVER)
    assert [int(n) for n in said.groups()] == [round(total), tries, round(REDIS_PY_SOCKET_TIMEOUT_S)]
    assert "each unanswered try's socket timeout besides" in text  # the redis_unavailable row
