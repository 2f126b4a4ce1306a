"""The settings files of MILI's programs (the worker, the gateway): flags over MILI_* environment
variables over a TOML file over the defaults. Imported by those programs only, never by the
client library itself, which needs no pydantic-settings."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, TomlConfigSettingsSource
from pydantic_settings.exceptions import SettingsError

from producer_client.errors import InvalidArgument

S = TypeVar("S", bound="TomlSettings")
SETTINGS_ERRORS = (ValidationError, SettingsError)
# The levels a program's `log_level` takes, in any case: logging refused another only when the
# program configured its logging (a ValueError traceback, at the worker's start).
LOG_LEVEL_PATTERN = r"^(?i:DEBUG|INFO|WARNING|ERROR)$"
# pydantic-settings' words for a MILI_* variable whose value is not the JSON its setting (a list, an
# object, a table of settings) needs: it names the field, not the variable nor what it wants.
ENV_NOT_JSON = re.compile(r'error parsing value for field "(\w+)" from source "EnvSettingsSource"')


class TomlSettings(BaseSettings):
    """A subclass names its default file in `model_config["toml_file"]`. A setting's value never
    appears in a validation error: it may be a Redis URL with its password, or an API key. A
    number setting is finite: `inf` passed the bounds of a timeout or an interval (inf > 0) and
    ended the program with an OverflowError where it became an integer (a worker's
    heartbeat_ttl_s, a gateway's batch_lease_s), or waited for ever; mili refused it already."""

    model_config = SettingsConfigDict(hide_input_in_errors=True, allow_inf_nan=False)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls)

    @classmethod
    def load(cls: type[S], config_file: Path | None = None, **flags: Any) -> S:
        """Settings from `flags` over the environment over `config_file` (default: the class's file)."""
        if config_file is None:
            return cls(**flags)
        if not Path(config_file).is_file():
            raise InvalidArgument("config", f"settings file {config_file} does not exist")
        bound: type[S] = type(cls.__name__, (cls,), {"model_config": {**cls.model_config, "toml_file": config_file}})
        try:
            return bound(**flags)
        except SETTINGS_ERRORS:
            raise
        except (ValueError, OSError) as e:  # tomllib's (tomli's on 3.10) TOMLDecodeError, a UnicodeDecodeError
            # The decoder's message names a line and column, never the file's text (a password).
            raise InvalidArgument("config", f"settings file {config_file} is not TOML that can be read: {e}") from None


def settings_error_line(error: Exception) -> str:
    """A settings error in one line, naming each setting and never its value."""
    if isinstance(error, ValidationError):
        return "; ".join(
            f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in error.errors(include_input=False)
        )
    found = ENV_NOT_JSON.match(str(error))
    if found is not None:
        return env_not_json_line(found.group(1))
    return str(error).split("\n", 1)[0]


def env_not_json_line(field: str) -> str:
    """The variables of `field` that are set (a table's, such as engine's, are MILI_ENGINE__<NAME>),
    and that their value must be JSON."""
    name = f"MILI_{field.upper()}"
    given = sorted(v for v in os.environ if v.upper() == name or v.upper().startswith(f"{name}__")) or [name]
    return (
        f"{field}: {' or '.join(given)} is not the JSON this setting takes from the environment:"
        """ a list or an object, such as MILI_API_KEYS='["KEY"]' or MILI_ENGINE__LORA_MODULES='{"sql": "/adapters/sql"}'"""
    )
