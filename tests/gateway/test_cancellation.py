"""A task that loses its cancel is cancelled again: on Python 3.11, asyncio.wait_for (which
redis-py sends every command through) returns the awaited call's result when the cancel comes
with it, and a gateway's stop then waited forever for its batch driver (gateway.cancellation)."""

from __future__ import annotations

import asyncio
import sys

import pytest

from gateway import cancellation
from gateway.batch.driver import BatchDriver
from gateway.cancellation import cancel_and_wait
from gateway.settings import GatewaySettings


@pytest.fixture(autouse=True)
def quick_recancel(monkeypatch):
    monkeypatch.setattr(cancellation, "RECANCEL_S", 0.02)


async def test_a_cancel_that_wait_for_loses_is_made_again():
    """The cancel comes in the loop iteration where the awaited future gets its result: CPython
    3.11's wait_for returns the result and the task carries on (3.12's raises)."""
    results: asyncio.Queue[asyncio.Future] = asyncio.Queue()

    async def send_commands_forever():
        while True:
            sent = asyncio.get_running_loop().create_future()
            await results.put(sent)
            await asyncio.wait_for(sent, 60)

    task = asyncio.ensure_future(send_commands_forever())
    (await results.get()).set_result(None)
    task.cancel()
    next_command = asyncio.ensure_future(results.get())
    await asyncio.wait({task, next_command}, return_when=asyncio.FIRST_COMPLETED)
    assert next_command.done() or sys.version_info >= (3, 12)  # 3.11: the task went on
    next_command.cancel()
    await asyncio.wait_for(cancel_and_wait([task]), 5)
    assert task.cancelled()


async def test_cancel_and_wait_gives_a_cancelled_task_time_for_its_way_out():
    """A task that cleans up on its cancel (gives a lease up) is cancelled once, not cut short."""
    released = asyncio.Event()

    async def hold_a_lease():
        try:
            await asyncio.sleep(60)
        finally:
            await asyncio.sleep(cancellation.RECANCEL_S / 4)  # a Redis round trip
            released.set()

    task = asyncio.ensure_future(hold_a_lease())
    await asyncio.sleep(0)
    await cancel_and_wait([task])
    assert released.is_set() and task.cancelled()


async def test_several_tasks_end_though_one_loses_its_cancel_again_and_again():
    """Beside tasks that end at their first cancel, one loses three: it is cancelled again once a
    RECANCEL_S (not in a busy loop) until it ends, and every task has ended when the wait returns."""
    lost = 0

    async def loses_three_cancels():
        nonlocal lost
        while True:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                if lost == 3:
                    raise
                lost += 1

    plain = [asyncio.ensure_future(asyncio.sleep(60)) for _ in range(3)]
    stubborn = asyncio.ensure_future(loses_three_cancels())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(cancel_and_wait([*plain, stubborn]), 5)
    assert lost == 3 and stubborn.cancelled() and all(t.cancelled() for t in plain)
    assert loop.time() - started >= 3 * cancellation.RECANCEL_S


class StoreThatSwallowsOneCancel:
    """A batch store whose read loses the first cancel, as redis-py's may on Python 3.11."""

    def __init__(self):
        self.swallowed = 0

    async def unfinished(self) -> list[str]:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if self.swallowed:
                raise
            self.swallowed += 1
        return []


async def test_a_batch_driver_stops_though_its_read_loses_the_cancel():
    store = StoreThatSwallowsOneCancel()
    driver = BatchDriver(store, client=None, registry=None, settings=GatewaySettings(batch_poll_s=0.01))
    driver.start()
    await asyncio.sleep(0.01)
    await asyncio.wait_for(driver.stop(), 5)
    assert driver.task.cancelled() and store.swallowed == 1
