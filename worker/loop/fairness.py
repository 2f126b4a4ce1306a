"""What a worker owes the lanes' counters (docs/architecture.md, "Sharing rules"). READ charges a
tenant an estimate of each job's tokens when it reads the entry (the prompt's estimate and
max_tokens); once the job is settled here, the ledger knows what it was served (its prompt and
output tokens; nothing for a duplicate, a job another worker took over, a job cancelled before it
ran) and owes the difference. The corrections ride with the worker's next READ, summed per lane
and tenant, so they cost no round trip of their own; a worker killed before sending them blurs the
shares a little and loses nothing else. Entries taken otherwise than by READ (reclaims, steals,
a blocking read of the queue's own stream, a worker's own stream) were charged nothing, so they
are charged what they were served."""

from __future__ import annotations

from producer_client.protocol.backlog import shard_parts
from worker.loop.intake import Delivery
from worker.loop.streams import Route

# (lane, tenant, shard) -> tokens: a queue of several shards has counters in each, and a job's
# correction goes to the shard that charged it.
Owed = dict[tuple[str, str, int], int]
Served = dict[tuple[str, str], int]  # (lane, tenant) -> tokens


class Ledger:
    def __init__(self) -> None:
        self.charges: dict[str, tuple[Route, int]] = {}  # entry reference -> its route, what READ charged
        self.refs: dict[str, set[str]] = {}  # job id -> the references charged for it
        self.owed: Owed = {}  # corrections not yet sent
        self.served: Served = {}  # tokens served since the metrics last took them

    def charge(self, deliveries: list[Delivery]) -> None:
        for d in deliveries:
            self.charges[d.entry_id] = (d.route, d.charged)
            self.refs.setdefault(d.job_id, set()).add(d.entry_id)

    def drop(self, job_id: str) -> None:
        """The job is let go of unsettled here: served elsewhere, if at all (that worker charges it)."""
        for ref in self.refs.pop(job_id, ()):
            self.settle(ref, 0)

    def settle(self, ref: str | None, served: int) -> None:
        """The entry `ref` is settled here, its job served `served` tokens (0: none, or not here)."""
        found = self.charges.pop(ref, None) if ref is not None else None
        if found is None or ref is None:
            return
        route, charged = found
        key = (route.lane, route.tenant)
        if served != charged:
            owed_key = (*key, shard_parts(ref)[0])
            self.owed[owed_key] = self.owed.get(owed_key, 0) + served - charged
        if served:
            self.served[key] = self.served.get(key, 0) + served

    def sent(self, corrections: Owed) -> None:
        """Redis took `corrections` (a copy of `owed` some time ago): what was added since stays."""
        for key, tokens in corrections.items():
            left = self.owed.get(key, 0) - tokens
            if left:
                self.owed[key] = left
            else:
                self.owed.pop(key, None)

    def take_served(self) -> Served:
        served, self.served = self.served, {}
        return served

    def forget(self) -> None:
        """Redis lost the queue's group, and the lanes' counters with it in all likelihood."""
        self.charges.clear()
        self.refs.clear()
        self.owed.clear()
