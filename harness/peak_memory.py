"""The memory a block of code takes at its peak, over what was held when it began.

On CUDA: allocated device memory (torch's peak counter, reset first). On CPU: resident memory,
whose high-water mark Linux resets on request (`5` into /proc/self/clear_refs), so an earlier
peak of the process does not count. Shared by tests/engine/test_long_context.py and
bench/long_context.py.
"""

from contextlib import contextmanager

import torch


def resident_bytes(field: str) -> int:
    """A /proc/self/status field in bytes: VmRSS (now) or VmHWM (the high-water mark)."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


@contextmanager
def peak_memory(device: torch.device, result: dict):
    """Sets result["bytes"] when the block ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        yield
        torch.cuda.synchronize(device)
        result["bytes"] = torch.cuda.max_memory_allocated(device) - before
        return
    before = resident_bytes("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    yield
    result["bytes"] = resident_bytes("VmHWM") - before
