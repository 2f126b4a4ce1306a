"""Continuous batching: which requests run this step, and how many tokens each extends.

Each step, in order of importance (the queue's lane, then priority, then arrival; see
`Request.sort_key`):
1. every running request that is decoding gets its one token;
2. running requests still in prefill get chunks under the token budget;
3. waiting requests are admitted while their pages (after the prefix match) and the
   budget allow, and none was preempted this step.
When a request cannot get the pages it needs, the cache evicts unlocked leaves; if that is
not enough the least important running request is preempted (vLLM's recompute
preemption: its pages go back, its KV pages are offered to the prefix cache, and it waits
to be recomputed). The most important request is never preempted for a less important
one, so it always progresses; a request that cannot fit even alone fails with
`kv_capacity_exceeded`. That is why the scheduler cannot deadlock.

Lanes (docs/architecture.md, "Sharing rules"): a waiting request that cannot be admitted, for
want of a slot (max_running) or of pages, preempts the least important running request of a
lower lane, and so on while there is one, rather than wait for it to finish. Within a lane a
request waits for a slot, as before; only pages preempt there. A step in which a priority request
prefills (admitted, or its prompt's next chunk) runs the priority lane alone: the lower lanes' requests
sit that one step out, so that its first token costs a step of its own and not one beside every
running decode (a step's cost grows with its batch and its contexts); never two steps in a row, so
the lower lanes still step at least every other step.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field

from worker.engine.errors import KVCapacityExceeded
from worker.engine.kv_pool import PageAllocator, pages_for
from worker.engine.outputs import RequestError, RequestId
from worker.engine.page_table import PageTable
from worker.engine.radix_cache import RadixCache
from worker.engine.request import Request, RequestStatus
from worker.engine.request_pages import RequestPages

log = logging.getLogger(__name__)

PRIORITY_LANE = 0  # Request.lane of the queue's priority lane
LOWEST_LANE = 2  # of its flex lane: a step that runs every lane runs up to it


@dataclass(slots=True)
class ScheduledChunk:
    """The model extends `request.token_ids[start : start + num_tokens]` this step; a decode
    with a draft (speculative decoding) extends its last token and then the draft's tokens,
    and samples at each of them (worker/engine/speculative)."""

    request: Request
    start: int
    num_tokens: int
    samples: bool  # the chunk reaches the end of the sequence, so it yields the next token
    draft: list[int] = field(default_factory=list)  # drafted tokens after the last one, to verify

    @property
    def input_ids(self) -> list[int]:
        own = self.request.token_ids[self.start : self.start + self.num_tokens - len(self.draft)]
        return own + self.draft if self.draft else own

    @property
    def num_sampled(self) -> int:
        """The rows of logits the chunk yields: one per token verified, none before its end."""
        return (1 + len(self.draft)) if self.samples else 0


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # ended with an error while scheduling
    budget: int = 0  # tokens the step could still take (drafts take from it)


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        cache: RadixCache,
        page_size: int,
        max_running: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self.max_model_len = max_model_len
        self.max_running = max_running
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Request] = []  # both kept sorted by Request.sort_key
        self.running: list[Request] = []
        self.page_table = PageTable()  # the running requests' pages, for the model runner
        self.pages = RequestPages(allocator, cache, page_size, self.page_table)
        self.num_preemptions = 0
        self.yielded = False  # the last step ran the priority lane alone (see _last_lane)

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        planned: dict[Request, int] = {}  # insertion-ordered: the step's chunks
        budget = self.max_num_batched_tokens
        preempted = False
        prefilling = []
        last_lane = self._last_lane()
        for req in list(self.running):  # decodes first: each gets its one token
            if req.status is not RequestStatus.RUNNING or req.lane > last_lane:
                continue  # preempted by a more important request earlier in this loop, or sitting this step out
            if req.ends_by_length(req.num_output_tokens, self.max_model_len):
                # Overlapped, its token in flight is its last (synchronous, it has already left `running`):
                # a row for it would compute what is discarded.
                continue
            if len(req.token_ids) - req.num_computed_tokens != 1:
                prefilling.append(req)
            elif budget > 0 and req.num_computed_tokens < len(req.pages) * self.page_size:
                planned[req] = 1  # the common case: its last page has room
                budget -= 1
            elif budget > 0:
                budget, preempted = self._plan_growth(req, 1, planned, budget, out, preempted)
        for req in prefilling:
            n = min(req.num_uncomputed_tokens, budget)
            if req.status is RequestStatus.RUNNING and n > 0:
                budget, preempted = self._plan_growth(req, n, planned, budget, out, preempted)
        if not preempted:
            budget = self._admit(planned, budget, out, last_lane)
        out.chunks = [
            ScheduledChunk(r, r.num_computed_tokens, n, r.num_computed_tokens + n == len(r.token_ids))
            for r, n in planned.items()
        ]
        out.budget = budget
        return out

    def _plan_growth(
        self,
        req: Request,
        n: int,
        planned: dict[Request, int],
        budget: int,
        out: SchedulerOutput,
        preempted: bool,
    ) -> tuple[int, bool]:
        """Plans `n` tokens of `req` if it gets their pages; the budget its victims held comes back."""
        grown, victims = self._grow(req, n, out)
        for v in victims:
            budget += planned.pop(v, 0)
        if grown:
            planned[req] = n
            budget -= n
        return budget, preempted or bool(victims)

    def commit(self, chunks: list[ScheduledChunk]) -> None:
        """Records that the model computed the chunks' KV. A drafted token's KV counts only once
        the token is accepted (`accept_draft_token`): a rejected one's slot is written over later."""
        for c in chunks:
            c.request.num_computed_tokens += c.num_tokens - len(c.draft)
            if c.num_tokens > 1 and not c.draft:  # prefill progress: share its full pages as soon as they exist
                self.pages.cache_computed(c.request)

    def accept_draft_token(self, req: Request) -> None:
        """A drafted token verified this step became the request's: its KV is the request's too."""
        req.num_computed_tokens += 1

    def finish(self, req: Request) -> None:
        """Takes a finished request out of the scheduler and returns its pages. It may be
        waiting: an overlapped engine reads a token after the request was preempted."""
        (self.running if req in self.running else self.waiting).remove(req)
        self.pages.release(req)

    def abort(self, request_id: RequestId) -> Request | None:
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self.pages.release(req)
                    return req
        return None

    def pages_owed(self) -> int:
        """Pages that running requests still need to finish their prefill (promised at admission)."""
        return sum(max(0, pages_for(len(r.token_ids), self.page_size) - len(r.pages)) for r in self.running)

    def pages_wanted_by_waiting(self) -> int:
        """Pages the waiting requests' sequences fill (before any prefix-cache hit)."""
        return sum(pages_for(len(r.token_ids), self.page_size) for r in self.waiting)

    def _last_lane(self) -> int:
        """The lowest lane that runs this step: the priority lane alone when one of its requests
        prefills (the head of the waiting queue, or a running one's next chunk of prompt) while a
        lower lane's request runs, unless the last step did so already; else every lane."""
        prefills = bool(self.waiting) and self.waiting[0].lane == PRIORITY_LANE and self.waiting[0].ready
        for req in self.running:  # sorted: the priority lane's requests come first
            if prefills or req.lane != PRIORITY_LANE:
                break
            prefills = req.num_uncomputed_tokens > 1
        self.yielded = prefills and not self.yielded and bool(self.running) and self.running[-1].lane > PRIORITY_LANE
        return PRIORITY_LANE if self.yielded else LOWEST_LANE

    def _admit(self, planned: dict[Request, int], budget: int, out: SchedulerOutput, last_lane: int) -> int:
        """Admits waiting requests in order while they fit, preempting running requests of lower
        lanes for them, none of a lane past `last_lane`. One whose grammar is still compiling is
        passed over: it holds no one back."""
        if not self.waiting or budget == 0:
            return budget
        if len(self.running) >= self.max_running and not self._outranks_running(self.waiting[0]):
            return budget  # nothing to admit: spares the pages_owed walk over every running request
        owed = self.pages_owed()
        i = 0
        while i < len(self.waiting) and budget > 0:
            req = self.waiting[i]
            if req.lane > last_lane:
                break  # waiting is sorted: the rest are of lanes past it too
            if not req.ready:
                i += 1
                continue
            if len(self.running) >= self.max_running:
                if not self._outranks_running(req):
                    break
                budget += self._preempt_lower(planned)
                owed = self.pages_owed()
                continue
            if pages_for(len(req.token_ids), self.page_size) > self.allocator.num_pages:
                self.waiting.pop(i)
                self._fail_too_large(req, out)
                continue
            match = self.cache.match_prefix(req.token_ids[:-1], req.adapter_name)  # the last token must run to sample
            self.cache.lock(match.node)
            need = pages_for(len(req.token_ids), self.page_size) - len(match.pages)
            if need > self.allocator.num_free + self.cache.evictable_pages - owed:
                self.cache.unlock(match.node)
                if not self._outranks_running(req):
                    break
                budget += self._preempt_lower(planned)
                owed = self.pages_owed()
                continue
            self.waiting.pop(i)
            self._start(req, match.pages, match.node)
            n = min(req.num_uncomputed_tokens, budget)
            self.pages.allocate(req, pages_for(req.num_computed_tokens + n, self.page_size) - len(req.pages))
            owed += pages_for(len(req.token_ids), self.page_size) - len(req.pages)
            planned[req] = n
            budget -= n
        return budget

    def _outranks_running(self, req: Request) -> bool:
        """Whether the least important running request is of a lower lane than `req`."""
        return bool(self.running) and self.running[-1].lane > req.lane

    def _preempt_lower(self, planned: dict[Request, int]) -> int:
        """Preempts the least important running request (of a lower lane: _outranks_running);
        returns the budget its planned chunk held."""
        victim = self.running[-1]
        self._preempt(victim)
        return planned.pop(victim, 0)

    def _start(self, req: Request, pages: list[int], node) -> None:
        self.pages.start(req, pages, node)
        req.status = RequestStatus.RUNNING
        bisect.insort(self.running, req, key=lambda r: r.sort_key)

    def _grow(self, req: Request, n: int, out: SchedulerOutput) -> tuple[bool, list[Request]]:
        """Gives `req` the pages for `n` more tokens, evicting cache leaves and then preempting
        less important requests. Returns (whether it got them, the requests preempted)."""
        need = pages_for(req.num_computed_tokens + n, self.page_size) - len(req.pages)
        victims: list[Request] = []
        while need > self.allocator.num_free:
            if self.cache.evict(need - self.allocator.num_free) > 0:
                continue
            victim = self.running[-1]
            if victim is req and len(self.running) == 1:
                if req.token_in_flight:
                    return False, victims  # that token may end it (a stop): judged once it is read
                self.running.remove(req)
                self._fail_too_large(req, out)
                return False, victims
            self._preempt(victim)
            victims.append(victim)
            if victim is req:
                return False, victims
        self.pages.allocate(req, need)
        return True, victims

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.pages.release(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.add(req)
        log.info(
            "preempted request %s (%d tokens, lane %d, priority %d)",
            req.request_id,
            len(req.token_ids),
            req.lane,
            req.priority,
        )

    def _fail_too_large(self, req: Request, out: SchedulerOutput) -> None:
        self.pages.release(req)
        error = KVCapacityExceeded(
            f"request {req.request_id} needs {pages_for(len(req.token_ids), self.page_size)} KV pages "
            f"for its {len(req.token_ids)} tokens; the whole pool holds {self.allocator.num_pages} pages "
            f"of {self.page_size} tokens"
        )
        req.finish("error", RequestError(error.code, error.message))
        out.failed.append(req)
        log.warning("%s", error.message)
