"""The API keys a request carries (`Authorization: Bearer KEY`), who each one is, and how an
address that keeps getting one wrong is answered.

A key is a tenant: the jobs, files, batches and Idempotency-Keys it creates are its own (a tenant's
id is a digest of its key, so no key is kept or shown anywhere). An `admin_api_keys` key is a tenant
too, that may also see and cancel every other tenant's jobs, files and batches. Without `api_keys`
the gateway is open and every request is the one anonymous tenant."""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import HTTPConnection

TENANT_ID_CHARS = 12  # of the key's SHA-256, in hex: no collision among any realistic set of keys
ANONYMOUS = "anonymous"


@dataclass(frozen=True)
class Tenant:
    id: str  # "k" + a digest of its key; ANONYMOUS on an open gateway
    admin: bool = False

    def owns(self, owner: str | None) -> bool:
        """Whether this tenant may see and change what `owner` created."""
        return self.admin or owner == self.id

    def owns_job(self, job_id: str) -> bool:
        """Whether this tenant may see the job `job_id`. A tenant's jobs have ids `<tenant>.<...>`
        (producer_client.new_job.fresh_job_id; an Idempotency-Key's: gateway/idempotency.py), and a
        tenant id has a fixed length without a dot, so no other key's id begins so; nor does a
        library's tenant's, whose name holds no dot either (keys.check_tenant). A job of no
        tenant (a producer's that names none, or one submitted before ids carried the tenant) is
        the default tenant's, which no API key is: an admin key's only."""
        return self.admin or job_id.startswith(f"{self.id}.")


OPEN = Tenant(ANONYMOUS, admin=True)  # an open gateway: one tenant, who sees everything


def tenant_id(key: str) -> str:
    return "k" + hashlib.sha256(key.encode()).hexdigest()[:TENANT_ID_CHARS]


def tenant_of(request: HTTPConnection) -> Tenant:
    """The request's tenant, set by the edge (gateway/edge.py) for every route that needs a key."""
    return request.scope.get("state", {}).get("tenant") or OPEN


def queue_tenant(owner: str | None) -> str | None:
    """The tenant a request's (or a batch owner's) jobs are submitted as: its share of each lane,
    its quota and rate limits (`mili quota set k0123456789ab`). An open gateway's are no tenant's,
    as a producer's that names none: they keep the queue's own stream."""
    return None if owner in (None, ANONYMOUS) else owner


def bearer_key(request: HTTPConnection) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def key_matches(given: str, keys: list[bytes]) -> bool:
    """compare_digest against every key: the time taken does not tell which key came close."""
    matches = [hmac.compare_digest(given.encode(), k) for k in keys]
    return any(matches)


class Access:
    """`api_keys` and `admin_api_keys` as tenants."""

    def __init__(self, api_keys: list[str], admin_keys: list[str]):
        self.keys = [k.encode() for k in [*api_keys, *admin_keys]]
        self.admin = [k.encode() for k in admin_keys]

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def tenant(self, given: str | None) -> Tenant | None:
        """The key's tenant; None for a missing or wrong key. OPEN when no key is configured."""
        if not self.required:
            return OPEN
        if given is None or not key_matches(given, self.keys):
            return None
        return Tenant(tenant_id(given), admin=key_matches(given, self.admin))


class AuthFailures:
    """Failed key and login attempts per client address, in fixed windows of WINDOW_S. Past
    `per_minute` failures in its window, an address's further failures are answered 429 until
    the window ends: at once, from the headers (no Redis command, no body read), and telling a
    client that retries a wrong key to stop. A right key is never refused, whatever its address
    has failed: behind a proxy or a NAT one address is many clients, and a lockout there would
    let any one of them shut the others out, while a guesser who changes address escapes it.
    Guessing is defeated by the keys' strength instead (gateway/key_strength.py). At most
    MAX_ADDRESSES are remembered (the oldest forgotten first), so that a flood of addresses
    cannot grow memory without bound."""

    WINDOW_S = 60.0
    MAX_ADDRESSES = 100_000

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic):
        self.per_minute = per_minute
        self.clock = clock
        self.windows: OrderedDict[str, tuple[float, int]] = OrderedDict()  # address -> (window start, failures)

    def failed(self, address: str) -> float | None:
        """Count a failed attempt of `address`: the seconds until its window ends if it is over
        its limit (the attempt's answer is a 429 saying so: retry-after-ms exact, Retry-After
        rounded up), else None (a 401)."""
        if self.per_minute <= 0:
            return None
        now = self.clock()
        start, failures = self.windows.pop(address, (now, 0))
        if now - start >= self.WINDOW_S:
            start, failures = now, 0
        self.windows[address] = (start, failures + 1)
        while len(self.windows) > self.MAX_ADDRESSES:
            self.windows.popitem(last=False)
        if failures < self.per_minute:
            return None
        return start + self.WINDOW_S - now
