"""The LoRA settings as an operator gives them (issue 46's interface): flags, TOML tables and the
environment's JSON all give lora_modules by name, and a bad value stops the worker before it
touches Redis or loads a model, with one line naming the setting."""

import os

import pytest

from worker.__main__ import build_parser, load_engine, main
from worker.engine import settings as engine_settings
from worker.settings import WorkerSettings, settings_from_args


def test_lora_flags_give_named_adapters_slots_host_cache_and_rank(tmp_path):
    settings = WorkerSettings.load(
        None,
        engine={
            "lora_modules": ["sql=/adapters/sql", "chat=/a=b"],  # a path may hold '='
            "lora_dir": str(tmp_path),
            "max_loras": 2,
            "max_cpu_loras": 6,
            "max_lora_rank": 128,
        },
    ).engine
    assert settings.lora_modules == {"sql": "/adapters/sql", "chat": "/a=b"}
    assert (settings.lora_dir, settings.max_loras, settings.host_loras, settings.max_lora_rank) == (
        str(tmp_path),
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


def test_a_lora_dir_that_is_missing_or_a_file_stops_the_worker_with_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """The worker started, logged the directory at INFO and served none of its adapters: every job
    naming one failed unknown_adapter. As a flag, in the settings file and in the environment."""
    (tmp_path / "file").write_text("")
    config = tmp_path / "worker.toml"
    config.write_text(f'[engine]\nlora_dir = "{tmp_path / "gone"}"\n')
    for name in [n for n in os.environ if n.startswith("MILI_")]:
        monkeypatch.delenv(name)
    for flags, given, why in (
        (["--lora-dir", str(tmp_path / "none")], tmp_path / "none", "does not exist"),
        (["--lora-dir", str(tmp_path / "file")], tmp_path / "file", "is not a directory"),
        (["--config", str(config)], tmp_path / "gone", "does not exist"),
    ):
        assert main(["--redis", "redis://localhost:1/0", *flags]) == 2
        assert (
            capsys.readouterr().err == f"error: invalid_argument: engine.lora_dir: Value error, {str(given)!r} {why}\n"
        )
    monkeypatch.setenv("MILI_ENGINE__LORA_DIR", str(tmp_path / "unset"))
    assert main(["--redis", "redis://localhost:1/0"]) == 2
    assert capsys.readouterr().err == (
        f"error: invalid_argument: engine.lora_dir: Value error, {str(tmp_path / 'unset')!r} does not exist\n"
    )


def test_a_lora_dir_the_worker_cannot_read_stops_it_with_one_line_naming_it(tmp_path, capsys):
    """A path stat itself fails on (a loop of links), or a directory closed to the worker's user:
    root may read any directory, so root's worker takes that one."""
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    closed = tmp_path / "closed"
    closed.mkdir(mode=0o000)
    assert main(["--redis", "redis://localhost:1/0", "--lora-dir", str(loop)]) == 2
    assert capsys.readouterr().err == (
        f"error: invalid_argument: engine.lora_dir: Value error, {str(loop)!r} cannot be read: "
        "Too many levels of symbolic links\n"
    )
    if os.geteuid() == 0:
        assert WorkerSettings.load(None, engine={"lora_dir": str(closed)}).engine.lora_dir == str(closed)
    else:
        assert main(["--redis", "redis://localhost:1/0", "--lora-dir", str(closed)]) == 2
        assert capsys.readouterr().err == (
            f"error: invalid_argument: engine.lora_dir: Value error, {str(closed)!r} cannot be read: "
            "Permission denied\n"
        )


def test_the_worker_looks_at_its_lora_dir_once_at_start(tmp_path, monkeypatch):
    """The worker's settings checked lora_dir at start, then Engine.from_pretrained checked the
    settings again as it loaded the model: a second look, with words of its own (no `engine.`)."""
    looked: list[str] = []
    check = engine_settings.check_readable_directory

    def counted(path, given):
        looked.append(given)
        check(path, given)

    monkeypatch.setattr(engine_settings, "check_readable_directory", counted)
    flags = ["serve", "--model", "tiny", "--device", "cpu", "--lora-dir", str(tmp_path)]
    settings = settings_from_args(build_parser().parse_args(flags))
    engine, _ = load_engine(settings)
    engine.close()
    assert looked == [str(tmp_path)]
