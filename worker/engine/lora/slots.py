"""Where read adapters are kept: a host cache of the most recently used ones, and the device's
slots, which the batch's rows index."""

from __future__ import annotations

import time
from collections import OrderedDict

from worker.engine.lora.adapters import AdapterHandle
from worker.model.lora import LoraStack, LoraTarget, SliceWeights
from worker.model.lora_adapter import LoraAdapter


class HostCache:
    """Up to `capacity` adapters read from disk, least recently used out first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._adapters: OrderedDict[str, LoraAdapter] = OrderedDict()

    def get(self, name: str) -> LoraAdapter | None:
        adapter = self._adapters.get(name)
        if adapter is not None:
            self._adapters.move_to_end(name)
        return adapter

    def put(self, adapter: LoraAdapter) -> None:
        self._adapters[adapter.name] = adapter
        self._adapters.move_to_end(adapter.name)
        while len(self._adapters) > self.capacity:
            self._adapters.popitem(last=False)

    def discard(self, name: str) -> None:
        self._adapters.pop(name, None)

    def names(self) -> list[str]:
        return list(self._adapters)


class DeviceSlots:
    """`count` slots in every projection's LoraStack; each holds one adapter or none."""

    def __init__(self, targets: dict[str, LoraTarget], count: int):
        self.targets = targets
        self.stacks: list[LoraStack] = list({id(t.stack): t.stack for t in targets.values()}.values())
        self.holders: list[AdapterHandle | None] = [None] * count
        self.installs = 0  # adapters installed, and the time that took on the engine's thread
        self.install_seconds = 0.0

    def victim(self, in_use: set[str], wanted: set[str], planned: set[int]) -> int | None:
        """An empty slot, else the least recently used one that no running request uses nor a more
        important waiting one wants (and not `planned` for another adapter); None when none is."""
        free = [
            s
            for s, h in enumerate(self.holders)
            if s not in planned and (h is None or (h.name not in in_use and h.name not in wanted))
        ]
        return min(free, key=lambda s: -1 if self.holders[s] is None else self.holders[s].last_used, default=None)

    def install(self, slot: int, handle: AdapterHandle, adapter: LoraAdapter) -> None:
        """Evicts the slot's adapter (its handle no longer has a slot) and installs `adapter`: every
        stack's slot is written, the ones the adapter leaves out with rank 0."""
        start = time.perf_counter()
        evicted = self.holders[slot]
        if evicted is not None:
            evicted.slot = None
        parts: dict[int, dict[int, SliceWeights]] = {}
        for module, weights in adapter.modules.items():
            target = self.targets[module]
            parts.setdefault(id(target.stack), {})[target.slice] = weights
        for stack in self.stacks:
            stack.install(slot, parts.get(id(stack), {}))
        self.holders[slot] = handle
        handle.slot = slot
        self.installs += 1
        self.install_seconds += time.perf_counter() - start

    def names(self) -> list[str]:
        return [h.name for h in self.holders if h is not None]
