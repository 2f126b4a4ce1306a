"""The API keys a request carries: `Authorization: Bearer KEY`, checked against the settings'
`api_keys` by the API's routes and the board's."""
from __future__ import annotations

import hmac

from starlette.requests import Request


def bearer_key(request: Request) -> str | None:
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


def key_matches(given: str, keys: list[bytes]) -> bool:
    """compare_digest against every key: the time taken does not tell which key came close."""
    matches = [hmac.compare_digest(given.encode(), k) for k in keys]
    return any(matches)
