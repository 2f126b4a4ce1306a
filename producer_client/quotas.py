"""Tenants' quotas and rate limits (docs/operating-the-queue.md, "Quotas and rate limits"): what
`mili quota set` writes (one hash per tenant: `max_waiting`, `rpm`, `tpm`, `weight`), what
producers read (cached for CACHE_S, as placement's view of the workers), and the rate limits'
state as the enqueue script reports it (`RateLimits`, which the gateway turns into OpenAI's
x-ratelimit-* headers). The limits hold per queue, as OpenAI's hold per model; the enqueue script
enforces them atomically for every producer and gateway at once (ENQUEUE_LANES)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from producer_client.cluster import AsyncRedis, SyncRedis
from producer_client.errors import InvalidArgument
from producer_client.keys import Keys, check_tenant
from producer_client.protocol import tenants
from producer_client.protocol.clock import epoch_ms
from producer_client.protocol.lanes import MAX_WEIGHT, MIN_WEIGHT
from producer_client.protocol.producer import NO_LIMITS, Limits
from producer_client.rate_limits import NO_RATE_LIMITS, RateLimits
from producer_client.steps import Runner, Steps

CACHE_S = 1.0  # how stale a producer's copy of a tenant's quota may be
DEFAULT_WEIGHT = 1.0  # a tenant's weight where none is set
MAX_LIMIT = 10**9
QUOTA_FIELDS = ("max_waiting", "rpm", "tpm", "weight")


class Quota(BaseModel):
    """A tenant's settings; None: no limit (weight: 1). A limit of 0 is refused: `unset` removes one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_waiting: int | None = Field(None, description="jobs nobody has read yet, across the queue's lanes")
    rpm: int | None = Field(None, description="requests per minute on each queue")
    tpm: int | None = Field(None, description="tokens per minute on each queue: prompt estimate + max_tokens")
    weight: float | None = Field(
        None, description="share of a lane's tokens against other tenants', from 0.001 to 1000 (1 by default)"
    )

    def limits(self) -> Limits:
        """As ENQUEUE_LANES takes them; the weight always (1 unless set), so that an unset weight
        reaches the scheduler too."""
        return Limits(self.rpm or 0, self.tpm or 0, self.max_waiting or 0, self.weight or DEFAULT_WEIGHT)


def check_quota(values: Mapping[str, Any]) -> Quota:
    """The settings `values` names, each checked: limits whole numbers from 1 to MAX_LIMIT, a
    weight a number from MIN_WEIGHT to MAX_WEIGHT. InvalidArgument names the first bad one."""
    for name, value in values.items():
        if name not in QUOTA_FIELDS:
            raise InvalidArgument(name, f"is not a quota setting ({', '.join(QUOTA_FIELDS)})")
        if value is None:
            continue
        if name == "weight":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not MIN_WEIGHT <= value <= MAX_WEIGHT:
                raise InvalidArgument("weight", f"must be a number from {MIN_WEIGHT:g} to {MAX_WEIGHT:g}")
        elif isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_LIMIT:
            raise InvalidArgument(
                name, f"must be a whole number from 1 to {MAX_LIMIT} (a limit of 0 would refuse everything: unset it)"
            )
    return Quota(**values)


def quota_of(fields: Mapping[str, str]) -> Quota:
    """A tenant's hash as written by set_quota; a field this version cannot read counts as unset."""
    values: dict[str, Any] = {}
    for name in QUOTA_FIELDS:
        try:
            values[name] = float(fields[name]) if name == "weight" else int(fields[name])
            check_quota({name: values[name]})
        except (KeyError, ValueError, InvalidArgument):
            values.pop(name, None)
    return Quota(**values)


def read_quota(keys: Keys, tenant: str) -> Steps[Quota]:
    fields = yield from tenants.quota_fields(keys, tenant)
    return quota_of(fields)


def check_unset(unset: Any) -> list[str]:
    """The names of the settings to remove. One name alone is refused: as an iterable it is its
    characters ('r' is not a quota setting; "" removed nothing, silently)."""
    if isinstance(unset, (str, bytes)) or not isinstance(unset, Iterable):
        raise InvalidArgument(
            "unset", f"must be a list of quota settings' names ({', '.join(QUOTA_FIELDS)}), not one: wrap it, [name]"
        )
    return list(unset)


def set_quota(keys: Keys, tenant: str, changes: Mapping[str, Any], unset: list[str]) -> Steps[Quota]:
    """Write `changes` and remove `unset` from the tenant's settings; returns them as they are now."""
    check_quota(changes)
    for name in unset:
        if name not in QUOTA_FIELDS:
            raise InvalidArgument("unset", f"{name!r} is not a quota setting ({', '.join(QUOTA_FIELDS)})")
        if changes.get(name) is not None:  # which one is meant? The write would win over the removal, or not
            raise InvalidArgument("unset", f"{name} is both set and unset: give one of the two")
    written = {name: str(value) for name, value in changes.items() if value is not None}
    yield from tenants.write_quota_fields(keys, tenant, written, unset)
    return (yield from read_quota(keys, tenant))


def all_quotas(keys: Keys) -> Steps[dict[str, Quota]]:
    """Every tenant with settings, by name."""
    names = yield from tenants.tenants_with_quotas(keys)
    replies = yield from tenants.quota_fields_of(keys, names)
    return {tenant: quota_of(fields) for tenant, fields in zip(names, replies) if fields}


def settings_keys_of_another_type(keys: Keys, names: list[str] | None) -> Steps[list[str]]:
    """Of the tenants `names` (None: every tenant of the index), those whose settings key holds
    another type (tenants.settings_of_another_type)."""
    found = (yield from tenants.tenants_with_quotas(keys)) if names is None else names
    return (yield from tenants.settings_of_another_type(keys, found))


class TenantQuotas:
    """The operator's view of every tenant's settings. Each method returns its outcome; over an
    asyncio client (`run` is steps.arun) an awaitable of it. Bad arguments raise InvalidArgument
    before anything is sent."""

    def __init__(self, client: SyncRedis | AsyncRedis, keys: Keys, run: Runner):
        self.client, self.keys, self.run = client, keys, run

    def get(self, tenant: str) -> Any:
        return self.run(self.client, read_quota(self.keys, check_tenant("tenant", tenant)))

    def set(self, tenant: str, unset: tuple[str, ...] = (), **settings: Any) -> Any:
        """Write `settings` (max_waiting, rpm, tpm, weight) and remove those named in `unset`;
        returns the tenant's settings as they are now. Producers see them within CACHE_S."""
        steps = set_quota(self.keys, check_tenant("tenant", tenant), settings, check_unset(unset))
        return self.run(self.client, steps)

    def all(self) -> Any:
        return self.run(self.client, all_quotas(self.keys))

    def of_another_type(self, names: list[str] | None = None) -> Any:
        """Of the tenants `names` (None: every tenant of the index), those whose settings key holds
        another type than MILI writes there: read as no settings, until an operator deletes it."""
        checked = None if names is None else [check_tenant("tenant", name) for name in names]
        return self.run(self.client, settings_keys_of_another_type(self.keys, checked))


class Quotas:
    """One client's copies of its tenants' settings, each read again once CACHE_S old."""

    def __init__(self, cache_s: float = CACHE_S):
        self.cache_s = cache_s
        self.read_at: dict[str, tuple[float, Limits]] = {}

    def limits_for(self, keys: Keys, tenant: str | None) -> Steps[Limits]:
        if tenant is None:
            return NO_LIMITS
        cached = self.read_at.get(tenant)
        if cached is not None and time.monotonic() - cached[0] < self.cache_s:
            return cached[1]
        limits = (yield from read_quota(keys, tenant)).limits()
        self.read_at[tenant] = (time.monotonic(), limits)
        return limits


def rate_limits_now(limits: Limits, tats: list[str | None], now_ms: int) -> RateLimits:
    """The limits as ENQUEUE_LANES would answer them at `now_ms`, from the rate hash's theoretical
    arrival times (HMGET r t)."""

    def state(tat: str | None, limit: int) -> tuple[int, int, float]:
        if not limit:
            return 0, 0, 0.0
        ahead = max(0.0, stored_ms(tat) - now_ms)
        return limit, math.floor(limit - ahead * limit / 60000 + 1e-9), math.ceil(ahead) / 1000

    return RateLimits(*state(tats[0], limits.rpm), *state(tats[1], limits.tpm))


def stored_ms(tat: str | None) -> float:
    """A time the rate hash holds, 0 (a full bucket) where it holds none or text that is no finite
    number: producers write that hash, as ENQUEUE_LANES reads it."""
    try:
        value = float(tat or 0)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def current_rate_limits(keys: Keys, queue: str, tenant: str | None, quotas: Quotas) -> Steps[RateLimits]:
    """`tenant`'s rate limits on `queue` now, without counting anything: its quota (as cached) and
    its rate hash, in one round trip when it has a limit, none otherwise."""
    limits = yield from quotas.limits_for(keys, tenant)
    if tenant is None or not limits.rated:
        return NO_RATE_LIMITS
    tats, now = yield from tenants.rate_state(keys, queue, tenant)
    return rate_limits_now(limits, tats, epoch_ms(now))
