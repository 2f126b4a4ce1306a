import pytest
import torch

from worker.engine.errors import OutOfPages
from worker.engine.kv_pool import KVCacheShape, PageAllocator, allocate_kv_caches, pages_for


def assert_consistent(allocator: PageAllocator) -> None:
    used = sum(allocator.refcount(p) > 0 for p in range(allocator.num_pages))
    assert allocator.num_used == used
    assert allocator.num_free + allocator.num_used == allocator.num_pages


def test_pages_return_to_the_free_list_when_the_last_reference_drops():
    alloc = PageAllocator(8)
    a = alloc.allocate(3)
    b = alloc.allocate(2)
    assert alloc.num_free == 3 and len(set(a + b)) == 5
    alloc.incref(a[:2])  # shared, e.g. by a prefix match
    alloc.decref(a)
    assert alloc.num_free == 4  # a[2] freed; a[0], a[1] still referenced
    assert [alloc.refcount(p) for p in a] == [1, 1, 0]
    alloc.decref(a[:2] + b)
    assert alloc.num_free == 8
    assert_consistent(alloc)


def test_allocating_more_than_free_raises_and_changes_nothing():
    alloc = PageAllocator(4)
    alloc.allocate(3)
    with pytest.raises(OutOfPages, match="asked for 2 KV pages, 1 free of 4"):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert_consistent(alloc)


def test_pages_for_rounds_up():
    assert [pages_for(n, 4) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_kv_caches_are_zeroed_per_layer_page_tensors():
    shape = KVCacheShape(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)
    caches = allocate_kv_caches(shape, 5, torch.device("cpu"))
    assert len(caches) == 3
    for k, v in caches:
        assert k.shape == v.shape == (5, 4, 2, 8) and k.dtype == torch.bfloat16
        assert not k.any() and not v.any()
