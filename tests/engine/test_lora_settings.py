"""The LoRA settings as an operator gives them (issue 46's interface): flags, TOML tables and the
environment's JSON all give lora_modules by name, and a bad value stops the worker before it
touches Redis or loads a model, with one line naming the setting."""

import pytest

from worker.__main__ import main
from worker.settings import WorkerSettings


def test_lora_flags_give_named_adapters_slots_host_cache_and_rank():
    settings = WorkerSettings.load(
        None,
        engine={
            "lora_modules": ["sql=/adapters/sql", "chat=/a=b"],  # a path may hold '='
            "lora_dir": "/adapters/more",
            "max_loras": 2,
            "max_cpu_loras": 6,
            "max_lora_rank": 128,
        },
    ).engine
    assert settings.lora_modules == {"sql": "/adapters/sql", "chat": "/a=b"}
    assert (settings.lora_dir, settings.max_loras, settings.host_loras, settings.max_lora_rank) == (
        "/adapters/more",
        2,
        6,
        128,
    )
    assert settings.serves_lora


def test_lora_modules_from_the_environment_is_a_json_object(monkeypatch):
    monkeypatch.setenv("MILI_ENGINE__LORA_MODULES", '{"sql": "/adapters/sql"}')
    settings = WorkerSettings.load(None).engine
    assert settings.lora_modules == {"sql": "/adapters/sql"}
    assert settings.host_loras == settings.max_loras == 4  # unset: as many as the device slots


def test_no_adapter_setting_serves_none():
    assert not WorkerSettings.load(None).engine.serves_lora


@pytest.mark.parametrize(
    "flags, line",
    [
        (["--lora-modules", "sql"], "engine.lora_modules: Value error, 'sql' is not NAME=PATH"),
        (["--lora-modules", "sql="], "engine.lora_modules: Value error, 'sql=' is not NAME=PATH"),
        (
            ["--lora-modules", "../up=/tmp"],
            (
                "engine.lora_modules: Value error, adapter name '../up' is not 1-128 letters, digits and ._:@/- "
                "starting with one of the first two"
            ),
        ),
        (["--max-loras", "4", "--max-cpu-loras", "2"], "max_cpu_loras: must be at least max_loras"),
        (["--max-loras", "0"], "engine.max_loras: Input should be greater than or equal to 1"),
        (["--max-lora-rank", "0"], "engine.max_lora_rank: Input should be greater than or equal to 1"),
        (["--max-lora-rank", "513"], "engine.max_lora_rank: Input should be less than or equal to 512"),
    ],
)
def test_a_bad_lora_setting_stops_the_worker_with_one_line_naming_it(flags, line, capsys):
    # An unreachable Redis: the settings are refused before the worker would wait for it.
    assert main(["--redis", "redis://localhost:1/0", *flags]) == 2
    assert capsys.readouterr().err == f"error: invalid_argument: {line}\n"
