"""The paged KV cache: per-layer page tensors, preallocated once, and the allocator that owns the pages."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from kernels.fp8 import FP8_DTYPE
from producer_client.errors import InvalidArgument
from worker.engine.errors import OutOfPages
from worker.model.batch import KVCaches

# Triton converts float8 e4m3 on Ada (8.9) and later; older GPUs have no such conversion.
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class KVCacheShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token * self.page_size


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


def kv_cache_dtype(setting: str, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The pool's dtype for EngineSettings.kv_cache_dtype: the model's (auto), or float8 e4m3."""
    if setting == "auto":
        return model_dtype
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
        have = ".".join(map(str, torch.cuda.get_device_capability(device)))
        raise InvalidArgument(
            "kv_cache_dtype", f"fp8_e4m3 needs a GPU of compute capability 8.9 or newer; {device} has {have}"
        )
    return FP8_DTYPE


def pages_for(num_tokens: int, page_size: int) -> int:
    return (num_tokens + page_size - 1) // page_size


def allocate_kv_caches(shape: KVCacheShape, num_pages: int, device: torch.device) -> KVCaches:
    # Zeroed, not empty: attention reads whole pages and masks the tail, and a NaN left
    # in an unused slot would survive a zero attention weight (0 * NaN = NaN).
    dims = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    return [
        (torch.zeros(dims, dtype=shape.dtype, device=device), torch.zeros(dims, dtype=shape.dtype, device=device))
        for _ in range(shape.num_layers)
    ]
