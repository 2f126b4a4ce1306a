"""Idempotency-Keys, scoped to the API key that sends them and bound to their request.

A request with `Idempotency-Key: K` has jobs `K-0`, `K-1`... on an open gateway, and
`<tenant>.K-0`... with API keys (gateway.api_keys.Tenant): another API key sending the same K
gets jobs of its own, and cannot reach, read or wait on the first key's. Each job is bound to a
digest of the whole request (route and validated body): the same key with another request is
refused with 422 (the IETF draft "The Idempotency-Key HTTP Header Field" answers so, as does
Stripe), never answered with the first request's result."""

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
        )
    return key


def scoped_key(request: Request) -> str | None:
    """The request's Idempotency-Key within its tenant: the prefix of its jobs' ids."""
    key = idempotency_key(request)
    tenant = tenant_of(request)
    if key is None or tenant is OPEN:
        return key
    return f"{tenant.id}.{key}"


def fingerprint(request: Request, body: BaseModel) -> str:
    """A digest of the request its jobs answer: its route and its validated body."""
    return hashlib.sha256(f"{request.url.path}\n{body.model_dump_json()}".encode()).hexdigest()
