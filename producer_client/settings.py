"""The settings files of MILI's programs (the worker, the gateway): flags over MILI_* environment
variables over a TOML file over the defaults. Imported by those programs only, never by the
client library itself, which needs no pydantic-settings."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, TomlConfigSettingsSource


class TomlSettings(BaseSettings):
    """A subclass names its default file in `model_config["toml_file"]`."""

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)

    @classmethod
    def load(cls, config_file: Path | None = None, **flags: Any):
        """Settings from `flags` over the environment over `config_file` (default: the class's file)."""
        if config_file is None:
            return cls(**flags)
        if not Path(config_file).is_file():
            raise FileNotFoundError(f"settings file {config_file} does not exist")
        bound = type(cls.__name__, (cls,), {"model_config": {**cls.model_config, "toml_file": config_file}})
        return bound(**flags)
