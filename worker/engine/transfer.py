"""Copies between the host and a CUDA device that never wait for the device's queued work.

A copy from pageable host memory may make the driver wait for the stream, and a blocking one
(`torch.tensor(values, device=cuda)`, `t.to(cuda)`, a list used as an index) waits for every
kernel queued before it. While the device runs one step and the host prepares the next, such
a wait hands the device's idle time back (worker.engine.overlap). Staged through pinned
memory, a copy is queued like a kernel and the host moves on; the caching host allocator
keeps the pinned block until the copy has run. On CPU these are plain tensors.
"""

from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor_on(values: list, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A host list as a tensor on `device` (also what to index a device tensor with, instead of the list)."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy queued behind the work that produces `t`: complete once the stream
    reaches it (record an event after it to know when)."""
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out
