"""The paged KV cache: per-layer page tensors, preallocated once, and the allocator that owns the pages."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import torch

from worker.engine.errors import KVCacheTooSmall, OutOfPages
from worker.model.batch import KVCaches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_page(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem


class PageAllocator:
    """Refcounted pages and a free list.

    A page is on the free list exactly when its refcount is 0, so the free count is the
    length of that list and `num_free + num_used == num_pages` holds by construction.
    A request holds one reference on every page in its page table; the radix cache holds
    one on every page it stores. Pages shared through a prefix match carry both.
    """

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._refcounts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def refcount(self, page: int) -> int:
        return self._refcounts[page]

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} KV pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcounts[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            self._refcounts[p] += 1

    def decref(self, pages: list[int]) -> None:
        for p in pages:
            self._refcounts[p] -= 1
            if self._refcounts[p] == 0:
                self._free.append(p)


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def num_pages_to_allocate(
    shape: KVCacheShape, device: torch.device, num_pages: int | None,
    kv_cache_mib: int, gpu_memory_utilization: float,
) -> int:
    """An explicit `num_pages` wins; otherwise a fraction of free GPU memory on CUDA
    (measured after the weights are loaded), or `kv_cache_mib` of host memory."""
    if num_pages is not None:
        return num_pages
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = int(free_bytes * gpu_memory_utilization)
    else:
        budget = kv_cache_mib * 2**20
    n = budget // shape.bytes_per_page
    if n < 1:
        raise KVCacheTooSmall(f"{budget} bytes of KV memory hold no page of {shape.bytes_per_page} bytes")
    return n


def allocate_kv_caches(shape: KVCacheShape, num_pages: int, device: torch.device) -> KVCaches:
    # Zeroed, not empty: attention reads whole pages and masks the tail, and a NaN left
    # in an unused slot would survive a zero attention weight (0 * NaN = NaN).
    dims = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    caches = [
        (torch.zeros(dims, dtype=shape.dtype, device=device), torch.zeros(dims, dtype=shape.dtype, device=device))
        for _ in range(shape.num_layers)
    ]
    log.info(
        "KV cache: %d pages x %d tokens (%.1f MiB, %s, %s)",
        num_pages, shape.page_size, num_pages * shape.bytes_per_page / 2**20, shape.dtype, device,
    )
    return caches
