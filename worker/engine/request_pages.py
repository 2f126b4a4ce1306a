"""How a request holds its KV pages: it gets them from the free pages, evicting the prefix
cache's unlocked leaves when those run short, and gives them back with its full pages offered to
the prefix cache first. The scheduler decides which request gets pages and when; this is how."""

from __future__ import annotations

from worker.engine.kv_pool import PageAllocator, pages_for
from worker.engine.page_table import PageTable
from worker.engine.radix_cache import RadixCache
from worker.engine.request import Request


class RequestPages:
    def __init__(self, allocator: PageAllocator, cache: RadixCache, page_size: int, page_table: PageTable):
        self.allocator = allocator
        self.cache = cache
        self.page_size = page_size
        self.page_table = page_table

    def start(self, req: Request, pages: list[int], node) -> None:
        """The request starts on the prefix cache's matched `pages` (locked at `node`): their KV is
        computed. Its first start records the lookup's hit in the cache's counters."""
        self.allocator.incref(pages)
        req.pages = list(pages)
        req.cache_node = node
        req.num_computed_tokens = len(pages) * self.page_size
        if req.num_preemptions == 0:
            req.num_cached_prompt_tokens = min(req.num_computed_tokens, req.num_prompt_tokens)
            self.cache.record_lookup(req.num_prompt_tokens, req.num_cached_prompt_tokens)

    def allocate(self, req: Request, n: int) -> None:
        if n > self.allocator.num_free:
            self.cache.evict(n - self.allocator.num_free)
        req.pages.extend(self.allocator.allocate(n))

    def reserve_draft(self, req: Request, num_tokens: int) -> int:
        """Pages for up to `num_tokens` drafted tokens after the request's next one, from free
        pages alone: a draft never evicts cached prefixes nor preempts anyone. Returns how many
        of them fit."""
        have = len(req.pages) * self.page_size - req.num_computed_tokens - 1  # slots past the next token
        if have < num_tokens:
            grant = min(pages_for(num_tokens - have, self.page_size), self.allocator.num_free)
            req.pages.extend(self.allocator.allocate(grant))
            have += grant * self.page_size
        return max(0, min(num_tokens, have))

    def release(self, req: Request) -> None:
        """Returns the request's pages, first offering its computed full pages to the prefix cache."""
        self.cache_computed(req)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        self.allocator.decref(req.pages)
        self.page_table.release(req)
        req.pages = []
        req.num_computed_tokens = 0

    def cache_computed(self, req: Request) -> None:
        """Offers the request's computed full pages to the prefix cache, which then holds them
        locked for it (a prefill shares its pages as soon as they exist)."""
        full = req.num_computed_tokens // self.page_size
        if full == 0 or not self.cache.enabled:
            return
        node = self.cache.insert(req.token_ids[: full * self.page_size], req.pages[:full], req.adapter_name)
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node
