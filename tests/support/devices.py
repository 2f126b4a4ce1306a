"""Device tests: the tests that run on the CUDA device where torch sees one, and what the GPU
acceptance counts per pytest step (scripts/acceptance/pytest_report.py), so that a step whose
device tests all skipped, or ran on the CPU, cannot read as a GPU pass.

A device test carries the `cuda` mark, `cuda(gpus=2)` for one that needs two GPUs (its module
picks the device by the same condition). Without the GPUs it asks for, it skips (its own skipif
says why) or runs on the CPU's stand-in: Triton's interpreter, the torch reference path. The
kernel tests that take tests/kernels' `device` fixture are device tests by rule: the fixture is
CUDA wherever torch sees it.

Each device test's JUnit record gets the property `device`: `cuda` where its process sees the GPUs
it asks for, `cpu` elsewhere (scripts/acceptance loads this plugin with -p into every pytest step;
tests/conftest.py into every run, for the mark)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

KERNEL_TESTS = Path(__file__).resolve().parents[1] / "kernels"
PROPERTY = "device"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "cuda(gpus=1): a device test, run on CUDA where torch sees `gpus` GPUs (tests/support/devices.py)",
    )


def takes_the_kernel_device(item: pytest.Item) -> bool:
    return KERNEL_TESTS in item.path.parents and "device" in getattr(item, "fixturenames", ())


@functools.cache
def visible_gpus() -> int:
    """Fixed for the process (CUDA_VISIBLE_DEVICES is read at its start); torch counts them anew at
    each call until CUDA is initialized."""
    import torch  # here: a run without device tests need not import it

    return torch.cuda.device_count()


def where(mark: pytest.Mark) -> str:
    return "cuda" if visible_gpus() >= mark.kwargs.get("gpus", 1) else "cpu"


def pytest_itemcollected(item: pytest.Item) -> None:
    """Marked as soon as collected: before -m and the other plugins read the marks."""
    if takes_the_kernel_device(item):
        item.add_marker(pytest.mark.cuda)


# Last: after any mark another plugin gives while collecting.
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        mark = item.get_closest_marker("cuda")
        if mark is not None:
            item.user_properties.append((PROPERTY, where(mark)))
