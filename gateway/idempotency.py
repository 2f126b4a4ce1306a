"""Idempotency-Keys, scoped to the API key that sends them and bound to their request.

A request with `Idempotency-Key: K` has jobs `K-0`, `K-1`... on an open gateway, and
`<tenant>.K-0`... with API keys (gateway.api_keys.Tenant): another API key sending the same K
gets jobs of its own, and cannot reach, read or wait on the first key's. An open gateway's jobs
are no tenant's, and a job's tenant is its id's up to the first dot (docs/architecture.md): there
a K with a dot (`team-a.x`) would make ids that read as a tenant's (a pinned Redis user's, a keyed
gateway's key's), so it is refused. Each job is bound to a digest of the whole request (route and
validated body): the same key with another request is refused with 422 (the IETF draft "The
Idempotency-Key HTTP Header Field" answers so, as does Stripe), never answered with the first
request's result."""

from __future__ import annotations

import hashlib

from pydantic import BaseModel
from starlette.requests import Request

from gateway.api_keys import OPEN, tenant_of
from openai_format.errors import bad_request
from producer_client.keys import NAME_PATTERN

# A job id has 128 characters: room for `<tenant>.` (13) and `-<choice>` (up to 5) besides the key.
IDEMPOTENCY_KEY_CHARS = 100


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get("idempotency-key")
    if key is not None and (len(key) > IDEMPOTENCY_KEY_CHARS or not NAME_PATTERN.fullmatch(key)):
        raise bad_request(
            f"Idempotency-Key must be 1-{IDEMPOTENCY_KEY_CHARS} letters, digits and ._:@/-, starting with a letter or digit",
            "Idempotency-Key",
            "string_above_max_length" if len(key) > IDEMPOTENCY_KEY_CHARS else "invalid_value",
        )
    return key


def scoped_key(request: Request) -> str | None:
    """The request's Idempotency-Key within its tenant: the prefix of its jobs' ids. Checked before
    anything is enqueued (Gateway.submit)."""
    key = idempotency_key(request)
    tenant = tenant_of(request)
    if key is None:
        return None
    if tenant is OPEN:
        return checked_open_key(key)
    return f"{tenant.id}.{key}"


def checked_open_key(key: str) -> str:
    if "." in key:
        raise bad_request(
            "Idempotency-Key must hold no '.' on a gateway without api_keys: its jobs' ids would begin "
            "with a tenant's (`<tenant>.`), and these jobs are no tenant's",
            "Idempotency-Key",
        )
    return key


def fingerprint(request: Request, body: BaseModel) -> str:
    """A digest of the request its jobs answer: its route and its validated body."""
    return hashlib.sha256(f"{request.url.path}\n{body.model_dump_json()}".encode()).hexdigest()
