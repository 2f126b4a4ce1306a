"""The board's parts that need no process: the throughput window and the signed sessions, over
several times their intervals on a clock the test drives."""

from __future__ import annotations

import pytest

from gateway.board.auth import SESSION_S, BoardAuth
from gateway.board.throughput import WINDOW_S, ThroughputMeter


def test_throughput_is_the_rate_over_the_last_minute():
    meter = ThroughputMeter()
    assert meter.observe("q", 1000.0, 0) is None  # one reading spans no time
    processed = 0
    rates = {}
    for second in range(1, 241):  # 30 jobs a minute for 100 s, then 120 a minute: four windows
        processed += 0.5 if second <= 100 else 2
        rates[second] = meter.observe("q", 1000.0 + second, int(processed))
    assert rates[30].over_s == 30 and rates[30].per_minute == pytest.approx(30, abs=2)
    assert rates[100].over_s == WINDOW_S and rates[100].per_minute == pytest.approx(30, abs=1)
    assert 30 < rates[130].per_minute < 120  # half the window before the change
    for second in (161, 200, 240):
        assert (rates[second].over_s, rates[second].per_minute) == (WINDOW_S, 120)


def test_throughput_starts_again_when_the_count_goes_back():
    meter = ThroughputMeter()
    meter.observe("q", 0.0, 500)
    assert meter.observe("q", 10.0, 600).per_minute == 600
    assert meter.observe("q", 20.0, 3) is None  # the stream was deleted, or Redis lost it
    assert meter.observe("q", 30.0, 13).per_minute == 60
    assert meter.observe("q", 40.0, None) is None  # no stream at all
    meter.forget_others(set())
    assert meter.readings == {}


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_session_is_signed_with_the_key_and_expires():
    clock = Clock(1_000_000.0)
    auth = BoardAuth(["key-one", "key-two"], clock)
    assert auth.session_for("wrong") is None
    session = auth.session_for("key-two")
    assert "key-two" not in session
    for elapsed in (0, SESSION_S / 2, SESSION_S - 1):
        clock.now = 1_000_000.0 + elapsed
        assert auth.session_valid(session), elapsed
    for elapsed in (SESSION_S, 2 * SESSION_S, 5 * SESSION_S):
        clock.now = 1_000_000.0 + elapsed
        assert not auth.session_valid(session), elapsed
    clock.now = 1_000_000.0
    expires, _, signature = session.partition(".")
    assert not auth.session_valid(f"{int(expires) + SESSION_S}.{signature}")  # a later expiry is not signed
    assert not auth.session_valid("")
    assert not auth.session_valid("garbage")
    assert not BoardAuth(["key-one"], clock).session_valid(session)  # key-two was removed: its sessions end
