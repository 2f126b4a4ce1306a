"""What bounds the memory of the batches one gateway drives at once: the bytes of jobs they have
out together (gateway/batch/budget.py: what fits, who waits, the room kept for the first batch
waiting, and each batch's equal share while others wait), and one input file validated at a
time. The batches driven at once against a real gateway: tests/gateway/test_batch_api.py."""

import asyncio
import time
from dataclasses import dataclass
from types import SimpleNamespace

from gateway.batch.budget import InFlightBudget
from gateway.batch.driver import BatchDriver, DrivenBatch
from gateway.settings import GatewaySettings
from producer_client.keys import Keys


@dataclass
class Held:
    """A batch's flight, as the budget reads it: the bytes of its lines out."""

    bytes: int = 0


def budget_of(limit: int, *batches: str) -> tuple[InFlightBudget, dict[str, Held]]:
    budget = InFlightBudget(limit)
    flights = {batch: Held() for batch in batches}
    for batch, flight in flights.items():
        budget.join(batch, flight)  # type: ignore[arg-type]  # the budget reads .bytes only
    return budget, flights


def add(budget: InFlightBudget, flights: dict[str, Held], batch: str, size: int) -> bool:
    """A batch's driver adding a line of `size` bytes if the budget admits it."""
    if not budget.admits(batch, size):
        return False
    flights[batch].bytes += size
    return True


def test_batches_add_what_fits_and_a_line_past_the_bound_waits():
    budget, flights = budget_of(100, "a", "b")
    assert add(budget, flights, "a", 60) and add(budget, flights, "b", 40)
    assert budget.used == 100 and not add(budget, flights, "a", 1)
    assert list(budget.waiting) == ["a"]
    flights["b"].bytes = 0  # b's line answered
    assert add(budget, flights, "a", 40) and not budget.waiting


def test_room_is_kept_for_the_first_batch_waiting_until_its_line_goes_in():
    """a waits for 50 bytes with 30 free: b's 10-byte line would fit, but would leave a's line no
    room once 20 more were answered, so it waits behind a's."""
    budget, flights = budget_of(100, "a", "b", "c")
    flights["c"].bytes = 70
    assert not add(budget, flights, "a", 50)
    assert not add(budget, flights, "b", 10)
    assert list(budget.waiting) == ["a", "b"]
    flights["c"].bytes = 50
    assert add(budget, flights, "a", 50)  # the room kept for it, first
    assert not add(budget, flights, "b", 10)  # full now: b is the first waiting
    flights["c"].bytes = 0
    assert add(budget, flights, "b", 10) and not budget.waiting


def test_a_batch_holding_its_share_adds_nothing_while_another_waits():
    """Two batches: a share is half the bound. a, past its share, takes no freed room while b
    waits for its turn; under its share again, it adds as before."""
    budget, flights = budget_of(100, "a", "b")
    flights["a"].bytes = 90
    assert not add(budget, flights, "b", 20)
    flights["a"].bytes = 60  # a's lines answered: room for b's, and for a's 10
    assert not add(budget, flights, "a", 10)  # b waits and a holds more than its share
    assert add(budget, flights, "b", 20)
    assert add(budget, flights, "a", 10)  # nobody waits now: a adds what fits
    assert budget.used == 90


def test_a_line_larger_than_the_bound_goes_alone_into_an_empty_budget():
    budget, flights = budget_of(100, "a", "b")
    assert add(budget, flights, "a", 150)
    assert not add(budget, flights, "b", 1)
    flights["a"].bytes = 0
    assert add(budget, flights, "b", 1)


def test_a_batch_that_leaves_gives_up_its_bytes_and_its_turn():
    budget, flights = budget_of(100, "a", "b")
    flights["a"].bytes = 100
    assert not add(budget, flights, "b", 80) and list(budget.waiting) == ["b"]
    budget.leave("b")
    assert not budget.waiting
    budget.leave("a")
    assert budget.used == 0


async def test_batches_driven_at_once_are_validated_one_at_a_time(monkeypatch):
    """A validation holds its input file whole (up to batch_max_file_bytes): three batches
    stepped at once had their files checked at once; one at a time now, each in its turn."""
    validating, most, validated = 0, 0, []

    async def validate(batch: DrivenBatch, fields: dict) -> None:
        nonlocal validating, most
        validating += 1
        most = max(most, validating)
        await asyncio.sleep(0.05)
        validating -= 1
        validated.append(batch.batch_id)

    monkeypatch.setattr(DrivenBatch, "validate", validate)
    driver = BatchDriver(None, SimpleNamespace(keys=Keys()), None, GatewaySettings())  # type: ignore[arg-type]
    fields = {"status": "validating", "expires_at": str(int(time.time()) + 3600)}

    async def step_until_validated(batch: DrivenBatch) -> None:
        while batch.batch_id not in validated:
            await batch.step(fields)

    await asyncio.gather(*(step_until_validated(DrivenBatch(driver, f"batch-{i}")) for i in range(3)))
    assert sorted(validated) == ["batch-0", "batch-1", "batch-2"] and most == 1
