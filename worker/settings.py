"""Worker settings. Precedence, highest first: command-line flags > MILI_* environment
variables > the TOML file (config/worker.toml unless --config names another) > defaults.
Engine settings sit in the `[engine]` table, `MILI_ENGINE__<NAME>` in the environment, and
plain `--<name>` flags."""

from __future__ import annotations

import argparse
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsConfigDict

from producer_client.connection import parse_url
from producer_client.errors import InvalidArgument
from producer_client.keys import DEFAULT_PREFIX, MAX_SHARDS, check_name
from producer_client.protocol.replication import Replication
from producer_client.protocol.shards import check_count_or_auto
from producer_client.schema import MAX_BODY_BYTES, MAX_TOKENS_LIMIT
from producer_client.settings import LOG_LEVEL_PATTERN, TomlSettings
from worker.engine.settings import EngineSettings

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parents[1] / "config" / "worker.toml"


class WorkerSettings(TomlSettings):
    model_config = SettingsConfigDict(
        env_prefix="MILI_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        toml_file=DEFAULT_CONFIG_FILE,
    )

    model: str = Field(
        "tiny", description='a preset (tiny, tiny-moe, small, qwen3-0.6b), "echo" (no model), or a checkpoint directory'
    )
    # Checked here: torch refused another only once the model loaded (a RuntimeError traceback).
    device: str = Field(
        "auto",
        pattern=r"^(auto|cpu|cuda(:\d{1,3})?)$",
        description="cpu, cuda, cuda:N; auto picks cuda when torch sees one",
    )
    dtype: str = Field("auto", description="float32, bfloat16, float16; auto keeps the checkpoint's own")
    redis: str = Field(
        "embedded",
        description="redis://, rediss://, unix://, redis+cluster:// or redis+sentinel:// URL; embedded starts a private redis-server",
    )
    queue: str = Field("default", description="the queue this worker serves")
    prefix: str = Field(DEFAULT_PREFIX, description="namespace of every Redis key")
    name: str = Field("", description="consumer name in the queue's group; empty means <hostname>-<pid>")
    # At most 2 s: a blocking read must end well inside redis-py's 5 s socket timeout.
    block_ms: int = Field(
        500, ge=1, le=2000, description="longest idle XREADGROUP block; bounds the reaction to SIGTERM"
    )
    heartbeat_interval_s: float = Field(1.0, gt=0.0, description="how often the heartbeat hash is refreshed")
    heartbeat_ttl_s: float = Field(
        5.0, gt=0.0, description="the worker counts as dead this long after its last heartbeat"
    )
    result_ttl_s: int = Field(
        3600,
        ge=1,
        description="a job's hash (its result) and, where kept, its event stream expire this long after it ends",
    )
    drain_grace_s: float = Field(30.0, ge=0.0, description="on SIGTERM, running jobs get this long to finish")
    claim_idle_ms: int = Field(
        15000,
        ge=1,
        description="a job's entry unrefreshed this long (its worker died or stalled) is reclaimed by another worker",
    )
    reclaim_interval_s: float = Field(
        2.0, gt=0.0, description="how often a worker with room looks for entries to reclaim"
    )
    max_deliveries: int = Field(
        3, ge=1, description="an entry delivered more often than this goes to the dead-letter stream (code poison)"
    )
    stream_interval_s: float = Field(
        0.05,
        gt=0.0,
        le=10.0,
        description="a streamed job's token reaches its readers at most this long after it is sampled; also how often a running job's cancel flag is read",
    )
    checkpoint_interval_s: float = Field(
        1.0,
        gt=0.0,
        le=60.0,
        description="a job nobody streams has its tokens recorded this often: what a crash makes the next run generate again",
    )
    max_buffered_tokens: int = Field(
        262144,
        ge=1,
        description="while Redis is unreachable, generation pauses once this many tokens await publication",
    )
    redis_backoff_max_s: float = Field(
        5.0, gt=0.0, description="longest wait between attempts to reach Redis again (the wait doubles from 0.05 s)"
    )
    wait_replicas: int = Field(
        0,
        ge=0,
        description="a final result counts as written (its entry is acknowledged) once this many replicas have it (WAIT); 0: off",
    )
    wait_timeout_ms: int = Field(
        1000, ge=1, description="how long one WAIT for wait_replicas blocks the worker's publisher at most"
    )
    placement: bool = Field(
        True,
        description="cache-aware placement: read a stream of this worker's own before the shared one, and advertise it, "
        "so that producers place a job on the worker likely to hold its prompt's prefix (docs/architecture.md)",
    )
    steal_delay_ms: int = Field(
        1000,
        ge=1,
        description="an entry placed on a busy or stalled worker and not read this long is taken by a worker with room",
    )
    placement_poll_ms: int = Field(
        50,
        ge=1,
        le=2000,
        description="with placement on a cluster (where its own stream and the shared one lie on different nodes), an idle worker's longest block on the shared stream: how long a job placed on it may wait",
    )
    queue_shards: int | Literal["auto"] | None = Field(
        None,
        description=f"spread the queue over this many shards (1-{MAX_SHARDS}), each under a hash tag of its own (docs/architecture.md, "
        '"A queue over several shards"); the queue\'s first worker or producer that names a count stores it, and a '
        "worker that names another refuses to start; auto: the count the queue has, or if it has none the Redis "
        "Cluster's number of masters (1 on one server or Sentinel) stored as its count; unset: the count the queue has "
        "(1 if none)",
    )
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1, description="larger job bodies fail with body_too_large")
    max_tokens_limit: int = Field(MAX_TOKENS_LIMIT, ge=1, description="larger max_tokens fail with invalid_argument")
    metrics_host: str = Field(
        "127.0.0.1",
        description="address of the Prometheus endpoint: 127.0.0.1 serves this host only (a shared host); "
        "0.0.0.0 every interface (a container, whose image sets it)",
    )
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus endpoint port; 0 binds any free port")
    allowed_hosts: list[str] = Field(
        [],  # pydantic copies it for each instance
        description="host names the Prometheus endpoint answers besides addresses, localhost and *.localhost "
        '(JSON list, "*" for any): another is refused with 400, as a page rebound by DNS to the endpoint names one '
        "(the gateway's setting of the same name)",
    )
    healthcheck_timeout_s: float = Field(
        1.5,
        gt=0.0,
        description="`python -m worker healthcheck` reports unhealthy, with the cause, once Redis has not answered "
        "for this long (one try, no retry), inside the probe's own timeout",
    )
    log_level: str = Field("INFO", pattern=LOG_LEVEL_PATTERN, description="DEBUG, INFO, WARNING, ERROR")
    engine: EngineSettings = EngineSettings()

    @field_validator("redis")
    @classmethod
    def _usable_url(cls, value: str) -> str:
        if value != "embedded":
            parse_url(value)
        return value

    @field_validator("queue_shards", mode="before")
    @classmethod
    def _a_shard_count(cls, value: Any) -> int | str | None:
        # A flag's or a variable's value is text: "3" is the count 3.
        if isinstance(value, str) and value.isascii() and value.isdigit():
            value = int(value)
        return None if value is None else check_count_or_auto("queue_shards", value)

    @field_validator("queue", "prefix", "name")
    @classmethod
    def _usable_in_keys(cls, value: str, info: ValidationInfo) -> str:
        return value if value == "" and info.field_name == "name" else check_name(info.field_name, value)

    @model_validator(mode="after")
    def _checkpoints_no_sooner_than_streams(self) -> WorkerSettings:
        if self.checkpoint_interval_s < self.stream_interval_s:
            raise InvalidArgument("checkpoint_interval_s", "must be at least stream_interval_s")
        return self

    @model_validator(mode="after")
    def _refresh_before_expiry(self) -> WorkerSettings:
        # A heartbeat living no longer than an interval expired between refreshes: the live worker
        # counted as dead for a moment of each (its healthcheck failed, the gateway left its model
        # out); one living under two read as stale (older than the time it has left) before each.
        least_s = 2 * self.heartbeat_interval_s
        if self.heartbeat_ttl_s < least_s:
            raise InvalidArgument(
                "heartbeat_ttl_s",
                f"{self.heartbeat_ttl_s:g} is too short: give at least {least_s:g} (twice heartbeat_interval_s "
                f"{self.heartbeat_interval_s:g} s): the heartbeat would go stale, or expire and count the live "
                "worker as dead, between two refreshes",
            )
        return self

    @model_validator(mode="after")
    def _refresh_before_reclaim(self) -> WorkerSettings:
        # A live worker refreshes its entries with every heartbeat; a claim_idle_ms that does not
        # leave room for a late heartbeat would let other workers take its running jobs.
        least_ms = 2000 * self.heartbeat_interval_s
        if self.claim_idle_ms < least_ms:
            raise _claim_too_short(
                self.claim_idle_ms,
                f"at least {least_ms:g} (twice heartbeat_interval_s {self.heartbeat_interval_s:g} s)",
                "one late heartbeat would let the other workers reclaim this worker's running jobs",
            )
        # After an outage every worker waits claim_idle_ms before it reclaims, while a worker whose
        # backoff wait was longest refreshes its entries only after that wait and a heartbeat (and
        # a WAIT for replicas, as long again: the loop waits for the publisher's round when it
        # settles one before adopting, and at the end of a drain).
        waits_ms = self.wait_timeout_ms if self.wait_replicas else 0
        floor_ms = 1000 * (self.redis_backoff_max_s + self.heartbeat_interval_s) + waits_ms
        if self.claim_idle_ms <= floor_ms:
            waits = f" + wait_timeout_ms {waits_ms} with wait_replicas" if waits_ms else ""
            raise _claim_too_short(
                self.claim_idle_ms,
                f"more than {floor_ms:g} (redis_backoff_max_s {self.redis_backoff_max_s:g} s + heartbeat_interval_s "
                f"{self.heartbeat_interval_s:g} s{waits})",
                "a worker back from a Redis outage refreshes its running jobs' entries only that long after, "
                "and the other workers would reclaim them first",
            )
        return self

    @model_validator(mode="after")
    def _wait_inside_the_socket_timeout(self) -> WorkerSettings:
        # A WAIT whose reply comes after redis-py stopped reading reads as Redis gone: the loop
        # backs off and sends the round again, which times out again, and no job after it ends.
        socket_timeout_s = None if self.redis == "embedded" else parse_url(self.redis).options.get("socket_timeout")
        Replication(self.wait_replicas, self.wait_timeout_ms).check_within(socket_timeout_s)
        return self


def _claim_too_short(claim_idle_ms: int, least: str, why: str) -> InvalidArgument:
    return InvalidArgument("claim_idle_ms", f"{claim_idle_ms} is too short: give {least}: {why}")


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per setting (engine settings too), absent unless given."""
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML settings file")
    for name, field in _flag_fields():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, default=argparse.SUPPRESS, help=field.description, **_flag_options(field))


def _flag_options(field: FieldInfo) -> dict[str, Any]:
    """How a setting's flag takes its value, by the setting's type."""
    kind = _scalar_type(field.annotation)
    origin = typing.get_origin(kind)
    if origin is dict:
        return {"nargs": "+", "metavar": "NAME=PATH"}
    if origin is typing.Literal:
        return {"choices": typing.get_args(kind)}
    if origin is list:
        return {"nargs": "*", "metavar": "NAME"}
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    return {"type": kind, "metavar": _metavar(field.annotation)}


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


def _metavar(annotation: Any) -> str:
    """INT for `int | None`; INT|auto for `int | Literal["auto"] | None`."""
    kinds = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    if not kinds:
        return str(annotation.__name__).upper()
    return "|".join(
        "|".join(typing.get_args(a)) if typing.get_origin(a) is typing.Literal else a.__name__.upper()
        for a in kinds
        if a is not type(None)
    )


def _scalar_type(annotation: Any) -> type:
    """int for `int | None`, and so on: flags cannot say None, leaving a setting out does. A union
    of several kinds (`int | Literal["auto"]`) is given as text, which the setting's validator reads."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        return kinds[0] if len(kinds) == 1 else str
    return annotation
