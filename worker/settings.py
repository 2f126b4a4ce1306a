"""Worker settings. Precedence, highest first: command-line flags > MILI_* environment
variables > the TOML file (config/worker.toml unless --config names another) > defaults.
Engine settings sit in the `[engine]` table, `MILI_ENGINE__<NAME>` in the environment, and
plain `--<name>` flags."""
from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict, TomlConfigSettingsSource

from producer_client.keys import DEFAULT_PREFIX
from producer_client.schema import MAX_BODY_BYTES, MAX_TOKENS_LIMIT
from worker.engine.settings import EngineSettings

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parents[1] / "config" / "worker.toml"


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="MILI_", env_nested_delimiter="__", extra="forbid", frozen=True,
        toml_file=DEFAULT_CONFIG_FILE,
    )

    model: str = "tiny"  # a preset (tiny, small, qwen3-0.6b), "echo", or a checkpoint directory
    device: str = "auto"  # cpu, cuda, cuda:N; auto picks cuda when there is one
    dtype: str = "auto"  # float32, bfloat16, float16; auto: the checkpoint's own
    redis: str = "embedded"  # a redis:// rediss:// unix:// URL, or embedded: a private redis-server
    queue: str = "default"
    prefix: str = DEFAULT_PREFIX  # namespace of every Redis key
    name: str = ""  # consumer name in the queue's group; empty: <hostname>-<pid>
    block_ms: int = Field(500, ge=1, le=60_000)  # longest idle XREADGROUP block; bounds reaction to SIGTERM
    heartbeat_interval_s: float = Field(1.0, gt=0.0)
    heartbeat_ttl_s: float = Field(5.0, gt=0.0)  # the worker counts as dead this long after its last heartbeat
    result_ttl_s: int = Field(3600, ge=1)  # job hash and event stream expire this long after the job ends
    drain_grace_s: float = Field(30.0, ge=0.0)  # on SIGTERM, running jobs get this long to finish
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1)
    max_tokens_limit: int = Field(MAX_TOKENS_LIMIT, ge=1)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = Field(9400, ge=0, le=65535)  # Prometheus endpoint; 0 = any free port (see heartbeat)
    log_level: str = "INFO"
    engine: EngineSettings = EngineSettings()

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)

    @classmethod
    def load(cls, config_file: Path | None = None, **flags: Any) -> WorkerSettings:
        """Settings from `flags` over the environment over `config_file` (default: config/worker.toml)."""
        if config_file is None:
            return cls(**flags)
        if not Path(config_file).is_file():
            raise FileNotFoundError(f"settings file {config_file} does not exist")
        bound = type(cls.__name__, (cls,), {"model_config": {**cls.model_config, "toml_file": config_file}})
        return bound(**flags)


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per setting (engine settings too), absent unless given."""
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML settings file")
    for name, field in _flag_fields():
        flag = "--" + name.replace("_", "-")
        kind = _scalar_type(field.annotation)
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS)
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, metavar=kind.__name__.upper())


def settings_from_args(args: argparse.Namespace) -> WorkerSettings:
    given = vars(args)
    flags: dict[str, Any] = {}
    engine: dict[str, Any] = {}
    for name, _ in _flag_fields():
        if name in given:
            (engine if name in EngineSettings.model_fields else flags)[name] = given[name]
    if engine:
        flags["engine"] = engine
    return WorkerSettings.load(given.get("config"), **flags)


def _flag_fields():
    for name, field in WorkerSettings.model_fields.items():
        if name != "engine":
            yield name, field
    yield from EngineSettings.model_fields.items()


def _scalar_type(annotation: Any) -> type:
    """int for `int | None`, and so on: flags cannot say None, leaving a setting out does."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return next(a for a in typing.get_args(annotation) if a is not type(None))
    return annotation
