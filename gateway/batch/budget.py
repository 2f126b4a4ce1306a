"""The bytes of Batch API jobs one gateway has out, all the batches it drives together
(`batch_gateway_in_flight_bytes`). Each batch's own Flight keeps it within `batch_in_flight_bytes`;
without this bound, N batches driven at once held N times that, in Redis and in the gateway's
memory (a line in flight keeps its request and its jobs' specs until it is answered).

A batch waits for room rather than fail, and while batches wait, room goes to them in turn:

- the first waiting batch's next line is reserved: no other batch adds a line that would leave
  it no room, so a line larger than a batch's share goes in once enough lines are answered;
- a batch holding its equal share or more (the bound over the batches in progress here) adds
  nothing while another batch waits, so each batch gets at least that share.

While no batch waits, any batch adds what fits. As in a Flight, a line goes alone into an empty
budget whatever its size (at most max_request_jobs_bytes). The lines a batch taken over had out
count at once, even past the bound: they are in Redis already; new lines wait until it is back
under."""

from __future__ import annotations

import asyncio
import contextlib

from openai_format.batch_flight import Flight


class InFlightBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.flights: dict[str, Flight] = {}  # batch id -> its flight, for each batch in progress here
        self.waiting: dict[str, int] = {}  # batch id -> the bytes of the line it waits to add, first come first
        self.room = asyncio.Event()  # set (and replaced) when lines are answered

    def join(self, batch_id: str, flight: Flight) -> None:
        self.flights[batch_id] = flight

    def leave(self, batch_id: str) -> None:
        """The batch is no longer driven here: its lines and its turn are given up."""
        self.flights.pop(batch_id, None)
        self.give_up_turn(batch_id)
        self.freed()

    def give_up_turn(self, batch_id: str) -> None:
        """The batch adds no line any more (it is ending): no room is kept for it."""
        self.waiting.pop(batch_id, None)

    @property
    def used(self) -> int:
        """The bytes of the jobs of every line added to a flight here and not yet answered."""
        return sum(flight.bytes for flight in self.flights.values())

    def admits(self, batch_id: str, size: int) -> bool:
        """Whether the batch may add a line of `size` bytes now; if not, it waits its turn."""
        first = next(iter(self.waiting), batch_id)
        reserved = self.waiting[first] if first != batch_id else 0
        used = self.used
        fits = used + size + reserved <= self.limit or used + reserved == 0
        if fits and not (self.others_wait(batch_id) and self.holds_its_share(batch_id)):
            self.waiting.pop(batch_id, None)
            return True
        self.waiting[batch_id] = size  # a batch waiting already keeps its place
        return False

    def others_wait(self, batch_id: str) -> bool:
        return any(waiting != batch_id for waiting in self.waiting)

    def holds_its_share(self, batch_id: str) -> bool:
        return self.flights[batch_id].bytes * len(self.flights) >= self.limit

    def freed(self) -> None:
        """Lines were answered: the batches waiting for room try again at once."""
        self.room.set()
        self.room = asyncio.Event()

    async def wait(self, batch_id: str, timeout_s: float) -> None:
        """`timeout_s`, a step's pace, or less for a batch that waits for room: until lines are
        answered. Such a batch has no lines out to wake it, and room was kept for it (or others
        took what it could have) while it slept."""
        if batch_id not in self.waiting:
            await asyncio.sleep(timeout_s)
            return
        with contextlib.suppress(asyncio.TimeoutError):  # TimeoutError from Python 3.11 on, not on 3.10
            await asyncio.wait_for(self.room.wait(), timeout_s)
