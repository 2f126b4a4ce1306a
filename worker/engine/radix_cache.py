"""Radix prefix cache over token ids, one page per edge step (SGLang's RadixCache, page-granular).

Only full pages are cached: a node's key is a whole number of pages and its `pages` hold
their KV. The tree keeps one allocator reference on every page it stores. A request that
uses a node locks it and all its ancestors (`lock_ref`), so eviction only ever takes
unlocked leaves, least recently used first. Invariant: the pages of an unlocked node are
referenced by the tree alone, so evicting it frees them.

KV computed under a LoRA adapter is that adapter's alone (its k and v projections may differ from
the base's), so each adapter has a tree of its own: a root per adapter name, the base model's
under None. No prefix is ever shared across adapters; eviction takes LRU leaves from all trees.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from worker.engine.kv_pool import PageAllocator


class TreeNode:
    __slots__ = ("parent", "children", "key", "pages", "lock_ref", "last_access")

    def __init__(self, parent: TreeNode | None, key: list[int], pages: list[int], last_access: int):
        self.parent = parent
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.key = key
        self.pages = pages
        self.lock_ref = 0
        self.last_access = last_access


@dataclass
class PrefixMatch:
    pages: list[int]
    node: TreeNode  # deepest matched node; lock it while the pages are in use


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True):
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._clock = itertools.count()
        self.roots: dict[str | None, TreeNode] = {}  # by adapter name; None: the base model
        self.root = self._root(None)
        self._evictable_pages = 0  # pages in unlocked nodes; kept because a walk per check is too slow
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    def _root(self, adapter: str | None) -> TreeNode:
        root = self.roots.get(adapter)
        if root is None:
            root = self.roots[adapter] = TreeNode(None, [], [], next(self._clock))
            root.lock_ref = 1  # a root is never evicted
        return root

    def match_prefix(self, tokens: list[int], adapter: str | None = None) -> PrefixMatch:
        """The longest cached page-aligned prefix of `tokens` computed under `adapter` (None: the
        base model). Touches the matched path (LRU)."""
        node, pages, i = self._root(adapter), [], 0
        if not self.enabled:
            return PrefixMatch(pages, node)
        ps, now = self.page_size, next(self._clock)
        while len(tokens) - i >= ps:
            child = node.children.get(tuple(tokens[i : i + ps]))
            if child is None:
                break
            matched = self._matching_pages(child.key, tokens, i)
            if matched < len(child.pages):
                child = self._split(child, matched)
            child.last_access = now
            pages.extend(child.pages)
            node, i = child, i + len(child.key)
        return PrefixMatch(pages, node)

    def record_lookup(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def insert(self, tokens: list[int], pages: list[int], adapter: str | None = None) -> TreeNode:
        """Cache `pages` as the KV of `tokens` (len(tokens) == len(pages) * page_size) under
        `adapter` (None: the base model).

        Where the tree already holds a prefix, its pages are kept and the caller's copies
        stay the caller's; new nodes take a reference on the caller's pages. Returns the
        node that ends the key, for the caller to lock.
        """
        if not self.enabled:
            return self.root
        ps, now = self.page_size, next(self._clock)
        node, i = self._root(adapter), 0
        while i < len(pages):
            first = tuple(tokens[i * ps : (i + 1) * ps])
            child = node.children.get(first)
            if child is None:
                child = TreeNode(node, tokens[i * ps : len(pages) * ps], pages[i:], now)
                node.children[first] = child
                self.allocator.incref(child.pages)
                self._evictable_pages += len(child.pages)
                return child
            matched = self._matching_pages(child.key, tokens[: len(pages) * ps], i * ps)
            if matched < len(child.pages):
                child = self._split(child, matched)
            child.last_access = now
            node, i = child, i + matched
        return node

    def lock(self, node: TreeNode) -> None:
        while node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_pages += len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages if unlocked leaves hold them, LRU first; returns pages freed."""
        free_before = self.allocator.num_free
        heap = [(n.last_access, id(n), n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        while heap and self.allocator.num_free - free_before < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = self._remove_leaf(node)
            if parent.parent is not None and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return self.allocator.num_free - free_before

    def clear(self) -> int:
        """Evict every unlocked node; returns pages freed."""
        return self.evict(self.allocator.num_pages)

    def cached_pages(self) -> int:
        return sum(len(n.pages) for n in self._nodes())

    def _matching_pages(self, node_key: list[int], tokens: list[int], start: int) -> int:
        """How many whole pages of `node_key` equal `tokens[start:]`, page by page."""
        ps, n = self.page_size, 0
        limit = min(len(node_key), len(tokens) - start) // ps
        while n < limit and node_key[n * ps : (n + 1) * ps] == tokens[start + n * ps : start + (n + 1) * ps]:
            n += 1
        return n

    def _split(self, child: TreeNode, num_pages: int) -> TreeNode:
        """Cut `child` after `num_pages` pages; the new upper node inherits its locks."""
        ps = self.page_size
        upper = TreeNode(child.parent, child.key[: num_pages * ps], child.pages[:num_pages], child.last_access)
        upper.lock_ref = child.lock_ref
        child.parent.children[tuple(upper.key[:ps])] = upper
        child.key, child.pages, child.parent = child.key[num_pages * ps :], child.pages[num_pages:], upper
        upper.children[tuple(child.key[:ps])] = child
        return upper

    def _remove_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        del parent.children[tuple(node.key[: self.page_size])]
        self._evictable_pages -= len(node.pages)
        self.allocator.decref(node.pages)
        return parent

    def _nodes(self):
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())
