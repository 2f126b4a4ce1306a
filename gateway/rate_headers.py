"""OpenAI's rate-limit headers on every answer to a tenant with limits: `x-ratelimit-limit-`,
`-remaining-` and `-reset-` of `requests` and of `tokens`, each dimension where the tenant (the
API key's) has a limit on it (`mili quota set`; docs/http-api.md, "Rate limits"). An answer that
enqueued jobs (or was refused for a limit) carries the limits as the enqueue script left them;
any other answer, the tenant's limits on the default queue now, read at one round trip. Resets
are written as OpenAI writes them: `20ms`, `1s`, `6m0s`."""

from __future__ import annotations

import asyncio
import logging

import redis

from gateway.api_keys import queue_tenant
from producer_client import AsyncClient
from producer_client.rate_limits import RateLimits

log = logging.getLogger("gateway")

# How long an answer waits for its headers' read: a read takes a round trip, but while Redis is
# away the client retries for seconds, and every answer to a limited tenant (a 404 that needs no
# Redis too) waited them out. Past it the answer goes without the headers.
RATE_HEADERS_TIMEOUT_S = 1.0

EXPOSED_RATE_LIMIT_HEADERS = [
    f"x-ratelimit-{what}-{name}" for name in ("requests", "tokens") for what in ("limit", "remaining", "reset")
]


def rate_limit_headers(limits: RateLimits) -> list[tuple[bytes, bytes]]:
    headers = []
    for name, limit, remaining, reset_s in (
        ("requests", limits.limit_requests, limits.remaining_requests, limits.reset_requests_s),
        ("tokens", limits.limit_tokens, limits.remaining_tokens, limits.reset_tokens_s),
    ):
        if limit:
            headers += [
                (f"x-ratelimit-limit-{name}".encode(), str(limit).encode()),
                (f"x-ratelimit-remaining-{name}".encode(), str(remaining).encode()),
                (f"x-ratelimit-reset-{name}".encode(), duration(reset_s).encode()),
            ]
    return headers


def duration(seconds: float) -> str:
    """A duration as OpenAI's headers write it (Go's): 0s, 250ms, 1s, 1.5s, 6m0s, 1h2m3s."""
    if 0 < seconds < 1:
        return f"{round(seconds * 1000)}ms"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours or minutes:
        text = f"{int(minutes)}m{text}"
    if hours:
        text = f"{int(hours)}h{text}"
    return text


class RateLimitHeaders:
    """ASGI middleware around the edge (gateway/edge.py), which names the request's tenant before
    it answers or refuses: its refusals of a known tenant (413, 415, 408) are answers to it too. A
    request the edge refused for its key has no tenant, and costs no Redis command here."""

    def __init__(self, app, client: AsyncClient):
        self.app = app
        self.client = client

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_limits(message) -> None:
            if message["type"] == "http.response.start":
                limits = await self.limits(scope)
                message["headers"] = [*message.get("headers", ()), *rate_limit_headers(limits)]
            await send(message)

        await self.app(scope, receive, send_with_limits)

    async def limits(self, scope) -> RateLimits:
        state = scope.setdefault("state", {})
        if "rate_limits" in state:
            return state["rate_limits"]
        tenant = state.get("tenant")
        if tenant is None:
            return RateLimits()
        try:
            return await asyncio.wait_for(
                self.client.as_tenant(queue_tenant(tenant.id)).rate_limits(), RATE_HEADERS_TIMEOUT_S
            )
        except (redis.RedisError, asyncio.TimeoutError) as e:  # the answer goes out without them
            log.warning("the tenant's rate limits could not be read: %r", e)
            return RateLimits()
