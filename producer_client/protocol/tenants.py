"""A tenant's keys outside the queue's streams: its quota settings (`mili quota set` writes the
hash, producers read it and pass it to ENQUEUE_LANES), the index of the tenants that have
settings, and its rate hash on a queue (GCRA's theoretical arrival times, which ENQUEUE_LANES
writes and a producer reads back for the x-ratelimit-* headers). Each operation a Steps
(producer_client.steps); the reads are safe to repeat (Repeatable)."""

from __future__ import annotations

from typing import Any

from producer_client.connection import is_other_type, unless_other_type
from producer_client.errors import InvalidQuotaKey
from producer_client.keys import Keys
from producer_client.steps import Repeatable, Steps, checked


def quota_fields(keys: Keys, tenant: str) -> Steps[dict[str, str]]:
    """The tenant's settings hash ({}: none set)."""
    (fields,) = yield Repeatable(lambda pipe: pipe.hgetall(keys.quota(tenant)))
    return settings_hash(fields)


def write_quota_fields(keys: Keys, tenant: str, written: dict[str, str], unset: list[str]) -> Steps[None]:
    """`written` set and `unset` removed in the tenant's settings, and the tenant in the index. Each
    key is first found of its type or missing (InvalidQuotaKey otherwise): the writes run apart
    (two keys, two slots), so one's WRONGTYPE came after the other had taken effect."""
    kinds = {keys.quota(tenant): "hash", keys.quotas(): "zset"}
    found = checked((yield Repeatable(lambda pipe: [pipe.type(key) for key in kinds])))
    for (key, kind), held in zip(kinds.items(), found):
        if held not in (kind, "none"):
            raise InvalidQuotaKey(key, held, kind)

    def add(pipe: Any) -> None:
        if written:
            pipe.hset(keys.quota(tenant), mapping=written)
        if unset:
            pipe.hdel(keys.quota(tenant), *unset)
        pipe.zadd(keys.quotas(), {tenant: 0})

    checked((yield add))


def tenants_with_quotas(keys: Keys) -> Steps[list[str]]:
    """The index: every tenant that has had settings, by name. An index of another type names
    none, as a tenant's settings hash of another type holds none (settings_hash): `mili quota
    show` printed Redis's WRONGTYPE."""
    (reply,) = yield Repeatable(lambda pipe: pipe.zrange(keys.quotas(), 0, -1))
    tenants: list[str] = unless_other_type(reply, [])
    return tenants


def quota_fields_of(keys: Keys, tenants: list[str]) -> Steps[list[dict[str, str]]]:
    """Each tenant's settings hash, in one round trip."""
    if not tenants:
        return []
    replies = yield Repeatable(lambda pipe: [pipe.hgetall(keys.quota(t)) for t in tenants])
    return [settings_hash(reply) for reply in replies]


def settings_of_another_type(keys: Keys, tenants: list[str]) -> Steps[list[str]]:
    """Of `tenants`, those whose settings key holds another type than a hash: every read takes it
    for no settings (settings_hash), so the tenant runs without limits, and `mili quota show` said
    it had none. HGETALL, not TYPE: the producers' ACL user, who runs `mili quota show TENANT`, may
    not send TYPE."""
    if not tenants:
        return []
    replies = yield Repeatable(lambda pipe: [pipe.hgetall(keys.quota(t)) for t in tenants])
    return [tenant for tenant, reply in zip(tenants, replies) if is_other_type(reply)]


def settings_hash(reply: Any) -> dict[str, str]:
    """A tenant's settings hash as HGETALL answered; a key of another type holds no setting, as a
    field that does not read counts as unset (quotas.quota_of): it raised WRONGTYPE from every
    submit of the tenant and every gateway answer to it."""
    if is_other_type(reply):
        return {}
    (fields,) = checked([reply])
    return dict(fields)


def rate_state(keys: Keys, queue: str, tenant: str) -> Steps[tuple[list[str | None], tuple[int, int]]]:
    """The tenant's theoretical arrival times on `queue`, requests' and tokens' (ms on Redis's
    clock; None: its bucket is full), and Redis's clock (TIME): one round trip."""
    key = keys.rate(queue, tenant)
    tats, now = yield Repeatable(lambda pipe: (pipe.hmget(key, "r", "t"), pipe.time()))
    if is_other_type(tats):
        tats = [None, None]  # a producer's key of another type: a full bucket, as ENQUEUE_LANES reads it
    checked([tats, now])
    return tats, now
