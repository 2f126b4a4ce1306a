import random

from hypothesis import given, settings
from hypothesis import strategies as st

from worker.engine.kv_pool import PageAllocator
from worker.engine.radix_cache import RadixCache

PS = 4


def make_cache(num_pages: int = 64, enabled: bool = True) -> RadixCache:
    return RadixCache(PageAllocator(num_pages), PS, enabled)


def cache_tokens(cache: RadixCache, tokens: list[int]):
    """What a finished request does: its pages (one ref, its own) go to the tree, then it lets go."""
    pages = cache.allocator.allocate(len(tokens) // PS)
    node = cache.insert(tokens[: len(pages) * PS], pages)
    cache.allocator.decref(pages)
    return pages, node


def assert_invariants(cache: RadixCache) -> None:
    unlocked = [n for n in cache._nodes() if n.lock_ref == 0]
    assert cache.evictable_pages == sum(len(n.pages) for n in unlocked)
    for n in unlocked:  # evicting an unlocked node frees its pages
        assert all(cache.allocator.refcount(p) == 1 for p in n.pages)
    for n in cache._nodes():
        assert len(n.key) == len(n.pages) * PS and n.pages
        assert n.lock_ref <= n.parent.lock_ref or n.parent.parent is None  # a root's lock_ref is its own
    tree_pages = [p for n in cache._nodes() for p in n.pages]
    assert len(tree_pages) == len(set(tree_pages))


def test_match_returns_the_longest_cached_whole_page_prefix():
    cache = make_cache()
    pages, _ = cache_tokens(cache, list(range(10)))  # 2 full pages; the last 2 tokens are not cached
    assert len(pages) == 2
    assert cache.match_prefix(list(range(10))).pages == pages
    assert cache.match_prefix(list(range(7))).pages == pages[:1]  # 7 tokens hold one whole page
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99]).pages == pages[:1]  # diverges inside page 2
    assert cache.match_prefix([9, 1, 2, 3]).pages == []
    assert_invariants(cache)


def test_a_diverging_insert_splits_the_node_at_a_page_boundary():
    cache = make_cache()
    a, _ = cache_tokens(cache, list(range(12)))
    b_tokens = list(range(8)) + [50, 51, 52, 53]
    b, _ = cache_tokens(cache, b_tokens)
    assert cache.cached_pages() == 4  # b's first two pages were already cached as a's
    assert cache.match_prefix(b_tokens).pages == a[:2] + b[2:]
    assert cache.match_prefix(list(range(12))).pages == a
    assert cache.allocator.num_used == 4  # b's duplicate copies of a's pages were freed
    assert_invariants(cache)


def test_locked_nodes_survive_eviction_and_unlocked_leaves_go_lru_first():
    cache = make_cache()
    old, _ = cache_tokens(cache, [1] * 8)
    new, _ = cache_tokens(cache, [2] * 8)
    pinned, node = cache_tokens(cache, [3] * 8)
    cache.lock(node)
    cache.match_prefix([2] * 8)  # touch: [1]* is now least recently used
    assert cache.evictable_pages == 4
    assert cache.evict(1) == 2  # a whole leaf goes
    assert cache.match_prefix([1] * 8).pages == []
    assert cache.match_prefix([2] * 8).pages == new
    assert cache.clear() == 2
    assert cache.match_prefix([3] * 8).pages == pinned  # locked: kept through clear()
    cache.unlock(node)
    assert cache.clear() == 2
    assert cache.allocator.num_free == cache.allocator.num_pages
    assert_invariants(cache)


def test_eviction_climbs_to_parents_that_become_leaves():
    cache = make_cache()
    cache_tokens(cache, list(range(8)))
    cache_tokens(cache, list(range(4)) + [9, 9, 9, 9])
    assert cache.cached_pages() == 3
    assert cache.evict(3) == 3
    assert cache.cached_pages() == 0 and cache.evictable_pages == 0


def test_a_prefix_cached_under_one_adapter_is_never_matched_under_another():
    cache = make_cache()
    tokens = list(range(12))
    base, _ = cache_tokens(cache, tokens)
    assert cache.match_prefix(tokens, "a").pages == []
    pages = cache.allocator.allocate(3)
    node = cache.insert(tokens, pages, "a")
    cache.allocator.decref(pages)
    assert cache.cached_pages() == 6  # the same tokens twice: once per adapter, never shared
    assert cache.match_prefix(tokens, "a").pages == pages
    assert cache.match_prefix(tokens).pages == base
    assert cache.match_prefix(tokens, "b").pages == []
    cache.lock(node)
    assert cache.clear() == 3  # the base's tree goes, "a"'s locked pages stay
    assert cache.match_prefix(tokens, "a").pages == pages
    cache.unlock(node)
    assert cache.clear() == 3
    assert cache.allocator.num_free == cache.allocator.num_pages
    assert_invariants(cache)


def test_disabled_cache_stores_and_matches_nothing():
    cache = make_cache(enabled=False)
    pages, node = cache_tokens(cache, list(range(8)))
    assert node is cache.root
    assert cache.match_prefix(list(range(8))).pages == []
    assert cache.allocator.num_free == cache.allocator.num_pages


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ilue"), st.integers(0, 2**32)), max_size=40))
def test_random_operations_keep_the_invariants(ops):
    cache = make_cache(num_pages=48)
    held = []  # (node, pages) locked by a pretend running request
    for op, seed in ops:
        rng = random.Random(seed)
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 24))]
        if op == "i" and len(tokens) // PS <= cache.allocator.num_free:
            cache_tokens(cache, tokens)
        elif op == "l":
            m = cache.match_prefix(tokens)
            cache.lock(m.node)
            cache.allocator.incref(m.pages)
            held.append((m.node, m.pages))
        elif op == "u" and held:
            node, pages = held.pop(rng.randrange(len(held)))
            cache.unlock(node)
            cache.allocator.decref(pages)
        elif op == "e":
            cache.evict(rng.randrange(1, 8))
        assert_invariants(cache)
    for node, pages in held:
        cache.unlock(node)
        cache.allocator.decref(pages)
    cache.clear()
    assert cache.allocator.num_free == cache.allocator.num_pages
