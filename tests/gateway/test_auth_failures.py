"""The failed-attempt limit (gateway.api_keys.AuthFailures) on a clock the test turns: past the
limit an address's failures are answered 429 with the time left of its window, to the
millisecond, each address on its own; a window that ends forgets its failures, window after
window."""

from __future__ import annotations

from gateway.api_keys import AuthFailures
from gateway.edge import too_many_failures
from gateway.errors import headers_of

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
    assert failures.failed("a") == 47.5
    clock.now += 47.25
    assert failures.failed("a") == 0.25
    assert failures.failed("b") is None  # another address has a window of its own


def test_a_refused_attempts_answer_says_the_time_left_to_the_millisecond_and_whole_seconds_rounded_up():
    """retry-after-ms said whole seconds (48000 for 47.5 s left), where the time left is known:
    OpenAI's SDKs read it first. Retry-After is whole seconds (RFC 9110 10.2.3), rounded up: never
    a retry that comes too soon."""
    clock = Clock()
    failures = AuthFailures(LIMIT, clock)
    for _ in range(LIMIT):
        failures.failed("a")
    clock.now += 12.5
    assert headers_of(too_many_failures(failures.failed("a"))) == {"Retry-After": "48", "retry-after-ms": "47500"}
    clock.now += 47.4995
    assert headers_of(too_many_failures(failures.failed("a"))) == {"Retry-After": "1", "retry-after-ms": "1"}


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
