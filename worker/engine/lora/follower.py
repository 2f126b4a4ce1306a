"""A tensor-parallel rank's LoRA adapters (ranks 1..N-1), kept as rank 0 decides through the step
ring: READ starts reading this rank's share of an adapter on a loader thread of its own, at the
time rank 0 starts its read; INSTALL puts it in the slot rank 0 put it in, before the step that
first uses the slot. An install waits for this rank's read only while that is not done (rank 0
took as long to read its share), or reads an adapter again that this rank's host cache dropped
and rank 0's kept."""

from __future__ import annotations

import time
from pathlib import Path

from worker.engine.lora.adapters import AdapterHandle
from worker.engine.lora.loader import AdapterLoader
from worker.engine.lora.slots import DeviceSlots, HostCache
from worker.engine.settings import EngineSettings
from worker.engine.step_ring import Kind, Message
from worker.model.lora import attach_lora
from worker.model.lora_adapter import AdapterError, LoraAdapter, read_adapter
from worker.model.qwen3 import Qwen3ForCausalLM
from worker.model.rank_failed import RankFailed

POLL_S = 0.001


class LoraFollower:
    def __init__(self, model: Qwen3ForCausalLM, settings: EngineSettings):
        targets = attach_lora(model, settings.max_loras, settings.max_lora_rank)
        dtype, pin = model.model.norm.weight.dtype, model.tp.device.type == "cuda"
        self.slots = DeviceSlots(targets, settings.max_loras)
        self.host = HostCache(settings.host_loras)
        self.loader = AdapterLoader(lambda h: read_adapter(h.name, h.path, targets, settings.max_lora_rank, dtype, pin))

    def take(self, message: Message) -> None:
        adapter = message.adapter
        handle = AdapterHandle(adapter.name, Path(adapter.path))
        if message.kind is Kind.ADAPTER_READ:
            self._take_reads()
            if self.host.get(adapter.name) is None:
                self.loader.request(handle)
        else:
            self.slots.install(adapter.slot, handle, self._wait_for(handle))

    def _wait_for(self, handle: AdapterHandle) -> LoraAdapter:
        while (adapter := self.host.get(handle.name)) is None:
            if not self.loader.loading(handle.name):
                self.loader.request(handle)
            time.sleep(POLL_S)
            self._take_reads()
        return adapter

    def _take_reads(self) -> None:
        for handle, result in self.loader.finished():
            if isinstance(result, AdapterError):  # rank 0 read it: this rank's share must read too
                raise RankFailed(f"LoRA adapter {handle.name} could not be read on this rank: {result.message}")
            self.host.put(result)
