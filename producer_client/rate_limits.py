"""A tenant's rate limits on a queue after a request, as the enqueue script (ENQUEUE_LANES) answers
them: what a submit returns beside its job's id, what RateLimited carries, and what the gateway
sends as OpenAI's x-ratelimit-* headers. Kept from the quotas' settings (producer_client.quotas),
so that the errors can name it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RateLimits:
    """A tenant's rate limits on a queue after a request, as the enqueue script answers them:
    each limit (0: none), what remains of it, and the seconds until its bucket is full again
    (OpenAI's x-ratelimit-limit-*, -remaining-*, -reset-*)."""

    limit_requests: int = 0
    remaining_requests: int = 0
    reset_requests_s: float = 0.0
    limit_tokens: int = 0
    remaining_tokens: int = 0
    reset_tokens_s: float = 0.0

    @classmethod
    def from_reply(cls, values: list[int | str]) -> RateLimits:
        """ENQUEUE_LANES's last six values."""
        lr, rr, sr, lt, rt, st = (int(v) for v in values)
        return cls(lr, max(0, rr), max(0, sr) / 1000, lt, max(0, rt), max(0, st) / 1000)

    @property
    def limited(self) -> bool:
        return bool(self.limit_requests or self.limit_tokens)


NO_RATE_LIMITS = RateLimits()
