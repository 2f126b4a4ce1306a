"""Adapters read from disk on a thread of their own, so that a step never waits for a read: the
engine asks for an adapter, steps on, and takes it once read (its requests wait meanwhile)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from worker.engine.lora.adapters import AdapterHandle
from worker.model.lora_adapter import AdapterError, LoraAdapter

log = logging.getLogger(__name__)


class AdapterLoader:
    """`request` queues a read (once per adapter until it is taken); `finished` hands over what was
    read since, each an adapter or the AdapterError that refused it."""

    def __init__(self, read: Callable[[AdapterHandle], LoraAdapter]):
        self._read = read
        self._requests: queue.SimpleQueue[AdapterHandle] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[AdapterHandle, LoraAdapter | AdapterError]] = queue.SimpleQueue()
        self._pending: set[str] = set()
        self.reads = 0  # adapters read (refusals aside), and the time that took on this thread
        self.read_seconds = 0.0
        threading.Thread(target=self._run, name="mili-lora-loader", daemon=True).start()

    def request(self, handle: AdapterHandle) -> None:
        if handle.name not in self._pending:
            self._pending.add(handle.name)
            self._requests.put(handle)

    def loading(self, name: str) -> bool:
        return name in self._pending

    def finished(self) -> list[tuple[AdapterHandle, LoraAdapter | AdapterError]]:
        done = []
        while True:
            try:
                handle, result = self._done.get_nowait()
            except queue.Empty:
                return done
            self._pending.discard(handle.name)
            done.append((handle, result))

    def _run(self) -> None:
        while True:
            handle = self._requests.get()
            start = time.perf_counter()
            try:
                result: LoraAdapter | AdapterError = self._read(handle)
            except AdapterError as e:
                result = e
            except Exception as e:  # a bug or an I/O error costs this adapter's jobs, not the worker
                log.exception("reading LoRA adapter %s failed", handle.name)
                result = AdapterError(f"{handle.path}: cannot be read: {type(e).__name__}: {e}")
            elapsed = time.perf_counter() - start
            if isinstance(result, LoraAdapter):
                self.reads += 1
                self.read_seconds += elapsed
                log.info(
                    "read LoRA adapter %s (rank %d, %.1f MiB) from %s in %.0f ms",
                    handle.name,
                    result.max_rank,
                    result.nbytes / 2**20,
                    handle.path,
                    elapsed * 1000,
                )
            else:
                log.error("refused LoRA adapter %s: %s", handle.name, result.message)
            self._done.put((handle, result))
