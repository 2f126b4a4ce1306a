"""bench/device_pace.py's models of a GPU step's time, and the pace they put on an engine's steps:
a step returns at once and the next waits out the device time of the one before."""

from __future__ import annotations

import time

import pytest

from bench.device_pace import FULL_BATCH, DeviceStep, pace_like_a_device


def test_a_constant_step_takes_the_full_step_whatever_its_batch():
    step = DeviceStep(12.0)
    assert step.seconds(1) == step.seconds(FULL_BATCH) == pytest.approx(0.012)


def test_a_step_by_batch_takes_the_weights_read_plus_each_requests_kv():
    step = DeviceStep(12.0, "batch")
    assert step.seconds(FULL_BATCH) == pytest.approx(0.012)
    # 1.192 GB of weights + one of 256 contexts' 30.572 GB of K and V, of a 31.764 GB step
    assert step.seconds(1) == pytest.approx(0.012 * (1.192 + 30.572 / 256) / 31.764)
    assert step.seconds(0) < step.seconds(1) < step.seconds(128) < step.seconds(FULL_BATCH)


def test_an_unknown_model_is_refused():
    with pytest.raises(ValueError, match="expected one of constant, batch"):
        DeviceStep(12.0, "quadratic")


def test_a_paced_step_returns_at_once_and_the_next_waits_out_its_device_time():
    class Engine:
        def __init__(self, batch: int):
            self.batch = batch

        def step(self) -> list[int]:
            return [0] * self.batch

    pace_like_a_device(Engine, DeviceStep(200.0, "batch"))
    full, single = Engine(FULL_BATCH), Engine(1)
    started = time.monotonic()
    assert full.step() == [0] * FULL_BATCH
    assert time.monotonic() - started < 0.1  # the first step's outputs at once
    full.step()
    assert time.monotonic() - started >= 0.2  # the second waited for the full batch's 200 ms
    started = time.monotonic()
    single.step()
    single.step()
    assert time.monotonic() - started < 0.1  # one request's step: ~4 ms of the 200
