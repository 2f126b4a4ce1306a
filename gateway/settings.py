"""Gateway settings. Precedence, highest first: command-line flags > MILI_* environment variables
> the TOML file (config/gateway.toml unless --config names another) > defaults. MILI_REDIS and
MILI_PREFIX mean what they mean to the workers and the `mili` CLI."""

from __future__ import annotations

import argparse
import ipaddress
import json
import re
import typing
from pathlib import Path
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from producer_client.client_base import DEFAULT_MAX_QUEUE_DEPTH
from producer_client.connection import parse_url
from producer_client.keys import DEFAULT_PREFIX, check_name
from producer_client.protocol.replication import Replication
from producer_client.schema import MAX_BODY_BYTES
from producer_client.settings import LOG_LEVEL_PATTERN, TomlSettings

DEFAULT_CONFIG_FILE = Path(__file__).resolve().parents[1] / "config" / "gateway.toml"


class GatewaySettings(TomlSettings):
    model_config = SettingsConfigDict(env_prefix="MILI_", extra="forbid", frozen=True, toml_file=DEFAULT_CONFIG_FILE)

    redis: str = Field(
        "redis://localhost:6379/0",
        description="redis://, rediss://, unix://, redis+cluster:// or redis+sentinel:// URL of the queue's Redis",
    )
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    prefix: str = Field(DEFAULT_PREFIX, description="namespace of every Redis key, as the workers'")
    api_keys: list[str] = Field(
        default_factory=list, description="accepted `Authorization: Bearer` keys (JSON list); empty: no authentication"
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="keys (JSON list) that may also see and cancel every key's jobs, files and batches; where set, "
        "the board's only keys",
    )
    monitoring_needs_key: bool = Field(
        False, description="/health and /metrics need an API key too (with api_keys set)"
    )
    max_json_bytes: int = Field(
        4 << 20,
        ge=1,
        description="the largest JSON request body; a larger one is refused with 413 before it is read",
    )
    # n=128 choices of a prompt as long as the presets' context (40,960 tokens, about 4 bytes each
    # as text: this project's docs and code read 3.8-4.2 with Qwen3's tokenizer) take 21 MiB.
    max_request_jobs_bytes: int = Field(
        32 << 20,
        ge=MAX_BODY_BYTES,
        description="the most bytes of job bodies one request (or Batch API line) may enqueue: each of its n choices "
        "is a job that holds the whole prompt; more is refused with 400 body_too_large before any is enqueued",
    )
    body_timeout_s: float = Field(
        60.0,
        gt=0.0,
        description="a request's whole body must arrive within this long of its headers, else 408 and the "
        "connection closes: a client that sends its body slowly holds no connection longer",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0.0,
        description="a request's head must arrive whole within this long of its connection's opening (or of its "
        "first byte), else 408 and the connection closes: a client that sends nothing, or its head slowly, holds "
        "no connection longer",
    )
    cors_origins: list[str] = Field(
        default_factory=list,
        description='origins granted CORS (JSON list, "*" for any); empty: none',
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description="host names an open gateway (no api_keys) answers besides addresses, localhost and *.localhost "
        '(JSON list, "*" for any): another is refused with 400, as a page rebound by DNS to the gateway names one',
    )
    trusted_proxies: list[str] = Field(
        default_factory=lambda: ["127.0.0.1"],
        description='proxies (JSON list of addresses or networks, "*" for any) whose X-Forwarded-For and -Proto are believed',
    )
    auth_failures_per_minute: int = Field(
        10,
        ge=0,
        description="wrong keys and logins an address may send per minute, then 429 (a right key is always served); "
        "0: no limit",
    )
    models: dict[str, str] = Field(
        default_factory=dict,
        description="model name -> queue (JSON object), over what the heartbeats say; merged over the file's map",
    )
    default_queue: str = Field("default", description="the queue of a POST /generate that names no model")
    job_timeout_s: float = Field(
        600.0, gt=0.0, description="a job's deadline from its enqueue; past it the request ends with 504"
    )
    max_connections: int = Field(
        5000,
        ge=1,
        description="Redis connections the gateway may hold: each job it waits for holds one (a blocking read)",
    )
    max_queue_depth: int = Field(DEFAULT_MAX_QUEUE_DEPTH, ge=1, description="a fuller queue answers 429")
    wait_replicas: int = Field(
        0, ge=0, description="a job is enqueued once this many replicas have it (WAIT), else 503; 0: off"
    )
    wait_timeout_ms: int = Field(1000, ge=1, description="how long a submit waits for wait_replicas at most")
    placement: bool = Field(
        True,
        description="cache-aware placement: a job goes to the worker likely to hold its prompt's prefix "
        "(docs/architecture.md); off, every job goes to the queue's shared stream",
    )
    follow_queue_shards: bool = Field(
        False,
        description="spread each queue's jobs over the shards the queue has (its stored count, read every 10 s: "
        "docs/architecture.md); off, every job goes to shard 0, which every worker reads",
    )
    retry_after_s: int = Field(1, ge=1, description="the Retry-After of a 429 (queue full)")
    keepalive_s: float = Field(
        5.0, gt=0.0, description="a stream with no token for this long gets a ': keep-alive' line"
    )
    stream_hold_s: float = Field(
        30.0,
        ge=0.0,
        description="a stream starts once its jobs begin (a prompt too long is then a 400), or after this long",
    )
    cancel_on_disconnect: bool = Field(True, description="a client that disconnects cancels its jobs")
    workers_refresh_s: float = Field(1.0, gt=0.0, description="how often the live workers' models are read again")
    health_timeout_s: float = Field(
        0.5,
        gt=0.0,
        description="GET /health answers 503 with the cause once Redis has not answered for this long (one try, "
        "no retry), inside a probe's own timeout: the default answers a probe with Kubernetes' default timeout "
        "(1 s) with time to spare",
    )
    log_level: str = Field("INFO", pattern=LOG_LEVEL_PATTERN, description="DEBUG, INFO, WARNING, ERROR")
    batch_max_file_bytes: int = Field(100 << 20, ge=1, description="the largest file POST /v1/files takes")
    batch_max_lines: int = Field(50_000, ge=1, description="the most requests a batch input file may hold")
    batch_completion_windows: list[str] = Field(
        default_factory=lambda: ["24h"],
        description='the completion_window values a batch may ask for (JSON list of "<n>s|m|h|d")',
    )
    batch_ttl_s: int = Field(
        7 * 24 * 3600, ge=1, description="files expire this long after they are written, batches after they end"
    )
    batch_in_flight: int = Field(1000, ge=1, description="a batch's lines submitted ahead of their answers")
    batch_in_flight_bytes: int = Field(
        64 << 20,
        ge=1,
        description="the bytes of a batch's jobs submitted ahead of their answers: a line that does not fit waits "
        "for earlier ones (a line goes alone whatever its size)",
    )
    # Four batches at their own bound. A line's request and specs stay in the gateway's memory
    # while its jobs are out, so this bounds the gateway's batch memory as well as Redis's.
    batch_gateway_in_flight_bytes: int = Field(
        256 << 20,
        ge=1,
        description="the bytes of jobs submitted ahead of their answers by all the batches one gateway drives "
        "together: a batch waits for room, and while batches wait each gets at least an equal share",
    )
    batch_lease_s: float = Field(
        10.0, ge=1.0, description="a gateway that stops driving a batch loses it to another after this"
    )
    batch_poll_s: float = Field(1.0, gt=0.0, description="how often a gateway looks for batches no gateway drives")

    def routed_queues(self) -> frozenset[str]:
        """The queues this gateway routes to whatever the workers' heartbeats say: `default_queue`
        and the queues the `models` setting pins (served while scaled to zero)."""
        return frozenset({self.default_queue, *self.models.values()})

    @field_validator("redis")
    @classmethod
    def _existing_redis(cls, value: str) -> str:
        if value == "embedded":
            raise ValueError("a gateway joins the workers' Redis: give its URL (there is no embedded Redis here)")
        parse_url(value)
        return value

    @model_validator(mode="after")
    def _wait_inside_the_socket_timeout(self) -> GatewaySettings:
        # The gateway's client refuses it too, but only once uvicorn starts the app: a traceback.
        Replication(self.wait_replicas, self.wait_timeout_ms).check_within(
            parse_url(self.redis).options.get("socket_timeout")
        )
        return self

    @field_validator("api_keys", "admin_api_keys")
    @classmethod
    def _sendable_keys(cls, value: list[str], info) -> list[str]:
        """A key a client can send in `Authorization: Bearer`: an empty one (a shell variable unset
        in '["$KEY"]') matched a header with no key at all, opening the gateway to anyone, and one
        with a space or a character outside visible ASCII can never arrive as it is written. The
        message names the key's place, never the key."""
        for place, key in enumerate(value):
            if not SENDABLE_KEY.fullmatch(key):
                raise ValueError(
                    f"{info.field_name}[{place}] is empty or holds a space or a character outside visible ASCII"
                )
        return value

    @field_validator("prefix", "default_queue")
    @classmethod
    def _usable_in_keys(cls, value: str, info) -> str:
        return check_name(info.field_name, value)

    @field_validator("batch_completion_windows")
    @classmethod
    def _durations(cls, value: list[str]) -> list[str]:
        for window in value:
            duration_s(window)
        return value

    @field_validator("cors_origins")
    @classmethod
    def _origins_as_sent(cls, value: list[str]) -> list[str]:
        """CORS grants an Origin header equal to an entry; a browser sends `scheme://host[:port]`
        in lower case with no path, so an entry of another form (a URL's trailing slash, a path,
        no scheme) granted nothing, silently."""
        for place, origin in enumerate(value):
            if origin != "*" and not BROWSER_ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"cors_origins[{place}] {origin!r} is not an origin as a browser sends it: give "
                    'scheme://host[:port] in lower case, with no path or trailing slash, or "*"'
                )
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _addresses_or_networks(cls, value: list[str]) -> list[str]:
        """uvicorn keeps an entry that is neither as a literal that no client's address ever
        equals: a network written with its host bits set, or a name, would trust nobody, silently."""
        if value == ["*"]:
            return value
        for place, entry in enumerate(value):
            try:
                ipaddress.ip_network(entry) if "/" in entry else ipaddress.ip_address(entry)
            except ValueError as e:
                raise ValueError(
                    f'trusted_proxies[{place}] {entry!r} is not an address, a network or "*" alone: {e}'
                ) from None
        return value

    @field_validator("models")
    @classmethod
    def _queues_usable_in_keys(cls, value: dict[str, str]) -> dict[str, str]:
        for queue in value.values():
            check_name("models", queue)
        return value


SENDABLE_KEY = re.compile(r"[\x21-\x7e]+")
BROWSER_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\sA-Z]+")  # an Origin header's serialization
DURATION = re.compile(r"([1-9][0-9]*)([smhd])")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration_s(text: str) -> int:
    """`24h`, `30m`... in seconds."""
    match = DURATION.fullmatch(text)
    if match is None:
        raise ValueError(f"{text!r} is not a duration such as 24h, 30m or 90s")
    return int(match[1]) * SECONDS[match[2]]


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One `--kebab-case` flag per setting, absent unless given; lists and maps take JSON."""
    parser.add_argument("--config", type=Path, default=argparse.SUPPRESS, help="TOML settings file")
    for name, field in GatewaySettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        kind = _flag_type(field.annotation)
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=field.description
            )
        else:
            parser.add_argument(flag, type=kind, default=argparse.SUPPRESS, help=field.description)


def settings_from_args(args: argparse.Namespace) -> GatewaySettings:
    given = vars(args)
    flags = {name: given[name] for name in GatewaySettings.model_fields if name in given}
    return GatewaySettings.load(given.get("config"), **flags)


def _flag_type(annotation: Any):
    return _json_flag if typing.get_origin(annotation) in (list, dict) else annotation


def _json_flag(text: str) -> Any:
    """A list's or a map's flag, read as JSON. Refused without its text, which may hold an API key
    (argparse's own words were `invalid loads value: '<the text>'`)."""
    try:
        return json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"is not JSON: {e}") from None
