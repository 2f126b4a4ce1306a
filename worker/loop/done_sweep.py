"""The `done` streams of the jobs this worker ended, deleted DONE_TTL_MS after each end.

END_JOB gives a job's done stream a TTL of DONE_TTL_MS (producer_client/keys.py): long enough to
wake the job's readers, after which the result is read from the job's hash. But Redis reclaims an
expired key that nobody reads only when its active expiry cycle samples it, and that cycle stops
sampling once fewer than 10% of the keys it samples have expired: with every kept job's hash
carrying its result_ttl_s, a million kept jobs left ~27 expired done streams reclaimed a second,
each ~4.4 KB (bench/RESULTS.md, "A million results kept"). So the worker that ended a job deletes
its done stream itself, once DONE_TTL_MS has passed on its own clock since Redis answered the end
(Redis's end came before that answer: never early), with the next publication round. The TTL stays,
for the done streams of a worker killed before it deleted them and of jobs ended by producers
(cancels of queued jobs)."""

from __future__ import annotations

from collections import deque

from producer_client.keys import DONE_TTL_MS

DELAY_S = DONE_TTL_MS / 1000  # from the end's answer to the done stream's deletion


class DoneSweep:
    """Job ids whose done stream is due for deletion, in the order their ends were answered."""

    def __init__(self) -> None:
        self.ended: deque[tuple[float, str]] = deque()  # (when its done stream is due, job id)

    def __len__(self) -> int:
        return len(self.ended)

    def add(self, job_id: str, answered_at: float) -> None:
        """Redis answered the job's end at `answered_at` (monotonic)."""
        self.ended.append((answered_at + DELAY_S, job_id))

    def due(self, now: float) -> list[str]:
        """The jobs whose done stream is due by `now`, taken out."""
        taken = []
        while self.ended and self.ended[0][0] <= now:
            taken.append(self.ended.popleft()[1])
        return taken
