"""The failed-attempt limit (gateway.api_keys.AuthFailures) on a clock the test turns: past the
limit an address's failures are answered 429 with the seconds left of its window as Retry-After,
each address on its own; a window that ends forgets its failures, window after window."""

from __future__ import annotations

from gateway.api_keys import AuthFailures

LIMIT = 3


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_failures_past_the_limit_get_the_windows_remaining_seconds():
    clock = Clock()
    failures = AuthFailures(LIMIT, clock)
    assert [failures.failed("a") for _ in range(LIMIT)] == [None] * LIMIT
    assert failures.failed("a") == 60
    clock.now += 12.5
    assert failures.failed("a") == 48  # rounded up: never a Retry-After that comes too soon
    clock.now += 47.0
    assert failures.failed("a") == 1
    assert failures.failed("b") is None  # another address has a window of its own


def test_each_window_forgets_the_last_ones_failures_several_windows_running():
    clock = Clock()
    failures = AuthFailures(LIMIT, clock)
    for _ in range(5):
        assert [failures.failed("a") for _ in range(LIMIT + 2)] == [None] * LIMIT + [60, 60]
        clock.now += AuthFailures.WINDOW_S


def test_no_limit_at_zero():
    failures = AuthFailures(0, Clock())
    assert {failures.failed("a") for _ in range(100)} == {None}


def test_at_most_max_addresses_are_remembered_the_oldest_forgotten_first(monkeypatch):
    monkeypatch.setattr(AuthFailures, "MAX_ADDRESSES", 2)
    failures = AuthFailures(1, Clock())
    for address in ("a", "b", "c"):
        failures.failed(address)
    assert list(failures.windows) == ["b", "c"]
    assert failures.failed("a") is None  # forgotten: its first failure again
