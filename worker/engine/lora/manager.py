"""The engine's LoRA adapters: a request names one, waits until it is in a device slot, and runs
with it; the slots and the host cache keep the least recently used adapters out first.

Each step, before the scheduler admits anyone, `prepare` walks the waiting requests in the order
they would be admitted. An adapter in the host cache is installed in a slot at once (a copy into
the stacks, queued on the device's stream behind the steps already queued); one that is not is
asked of the loader thread, if a slot could take it. A slot is taken from an adapter only when no
running request uses it and no waiting request ahead wants it: a job whose adapter cannot get a
slot waits, never fails, and the slots do not thrash between adapters waiting behind each other.
An adapter the loader refuses ends its waiting requests with its error. Nothing here reads a file
on the engine's thread but the named adapters' checks at start: an adapter of lora_dir is looked
up by its directory (one stat) when a job names it, and checked by the loader as it reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from producer_client.errors import UnknownAdapter
from worker.engine.lora.adapters import AdapterHandle, AdapterSource
from worker.engine.lora.loader import AdapterLoader
from worker.engine.lora.slots import DeviceSlots, HostCache
from worker.engine.settings import EngineSettings
from worker.engine.step_ring import AdapterMessage, Kind, StepRing
from worker.model.lora import LoraTarget, attach_lora
from worker.model.lora_adapter import AdapterError, LoraAdapter, check_adapter, read_adapter

if TYPE_CHECKING:
    from worker.engine.request import Request
    from worker.model.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)


class LoraManager:
    def __init__(
        self,
        targets: dict[str, LoraTarget],
        settings: EngineSettings,
        dtype: torch.dtype,
        pin: bool,
        ring: StepRing | None = None,
    ):
        self.source = AdapterSource(settings.lora_modules, settings.lora_dir)
        self.targets = targets
        self.max_rank = settings.max_lora_rank
        self.dtype = dtype
        self.pin = pin  # pinned host copies, so that installing one waits for no device work
        self.slots = DeviceSlots(targets, settings.max_loras)
        self.host = HostCache(settings.host_loras)
        self.handles: dict[str, AdapterHandle] = {}
        self.refused: dict[str, AdapterError] = {}  # named adapters refused at start, by name
        self.loader = AdapterLoader(self._read)
        self.ring = ring  # a tensor-parallel group's: the other ranks read and install as this one
        self._steps = 0

    @classmethod
    def attach(
        cls, model: Qwen3ForCausalLM, settings: EngineSettings, device: torch.device, ring: StepRing | None = None
    ) -> LoraManager:
        """Gives the model its adapter slots and checks the named adapters; one that is refused is
        logged in a line naming its file and the problem, and its jobs fail with it. `ring`: a
        tensor-parallel group's, where the other ranks learn what to read and install."""
        targets = attach_lora(model, settings.max_loras, settings.max_lora_rank)
        manager = cls(targets, settings, model.model.norm.weight.dtype, device.type == "cuda", ring)
        for name, path in manager.source.modules.items():
            try:
                check_adapter(path, targets, settings.max_lora_rank)
            except AdapterError as e:
                log.error("LoRA adapter %s refused: %s", name, e.message)
                manager.refused[name] = e
        log.info(
            "LoRA: %d device slots of rank %d, %d adapters in host memory; named adapters: %s%s",
            settings.max_loras,
            settings.max_lora_rank,
            settings.host_loras,
            ", ".join(manager.source.modules) or "none",
            f"; on demand from {manager.source.directory}" if manager.source.directory else "",
        )
        return manager

    def handle(self, name: str) -> AdapterHandle:
        """The handle of adapter `name` for a new request: UnknownAdapter for a name this worker does
        not serve, AdapterError for a named adapter refused at start."""
        handle = self.handles.get(name)
        if handle is not None:
            return handle
        if name in self.refused:
            raise self.refused[name]
        path = self.source.path_of(name)
        if path is None:
            raise UnknownAdapter(name, "by this worker")
        handle = self.handles[name] = AdapterHandle(name, path)
        return handle

    def prepare(self, waiting: list[Request], running: list[Request]) -> list[AdapterHandle]:
        """Takes what the loader read, places waiting requests' adapters in slots; returns the
        adapters refused since the last call, whose requests must end."""
        self._steps += 1
        refused = self._take_reads()
        self._place(waiting, running)
        return refused

    def served(self) -> list[str]:
        return self.source.names()

    def held(self) -> list[str]:
        """Adapters this worker holds (in a slot or in host memory): a job naming one loads nothing."""
        return sorted(set(self.slots.names()) | set(self.host.names()))

    def _take_reads(self) -> list[AdapterHandle]:
        refused = []
        for handle, result in self.loader.finished():
            if isinstance(result, AdapterError):
                handle.error = result
                if self.handles.get(handle.name) is handle:
                    del self.handles[handle.name]  # the next job naming it checks it again
                refused.append(handle)
            else:
                self.host.put(result)
        return refused

    def _place(self, waiting: list[Request], running: Iterable[Request]) -> None:
        wanted: set[str] = set()
        planned: set[int] = set()
        in_use: set[str] | None = None
        for req in waiting:
            handle = req.adapter
            if handle is None or handle.name in wanted:
                continue
            wanted.add(handle.name)
            handle.last_used = self._steps
            if handle.slot is not None or handle.error is not None:
                continue
            if in_use is None:
                in_use = self._in_use(running)
            slot = self.slots.victim(in_use, wanted, planned)
            if slot is None:
                return  # every slot is someone's: the rest wait
            adapter = self.host.get(handle.name)
            if adapter is None:
                self._request_read(handle)
                planned.add(slot)  # kept for it until it is read
            else:
                self._install(slot, handle, adapter)

    def _request_read(self, handle: AdapterHandle) -> None:
        if self.ring is not None and not self.loader.loading(handle.name):
            self.ring.send_adapter(Kind.ADAPTER_READ, AdapterMessage(-1, handle.name, str(handle.path)))
        self.loader.request(handle)

    def _install(self, slot: int, handle: AdapterHandle, adapter: LoraAdapter) -> None:
        if self.ring is not None:  # the other ranks install before the step that uses the slot, as this one
            self.ring.send_adapter(Kind.ADAPTER_INSTALL, AdapterMessage(slot, handle.name, str(handle.path)))
        self.slots.install(slot, handle, adapter)

    def _in_use(self, running: Iterable[Request]) -> set[str]:
        """Adapters of running requests, marked as just used."""
        used = set()
        for req in running:
            if req.adapter is not None:
                req.adapter.last_used = self._steps
                used.add(req.adapter.name)
        return used

    def _read(self, handle: AdapterHandle) -> LoraAdapter:
        return read_adapter(handle.name, handle.path, self.targets, self.max_rank, self.dtype, self.pin)
